"""When a request stops (stopping.StopChecker), the one place the engine and the server decide it.
Expectations by hand, over a character tokenizer (one id a character)."""
from __future__ import annotations

from types import SimpleNamespace

from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.sampling import SamplingParams
from jaxgpt.inference.stopping import StopChecker

CHARS = SimpleNamespace(decode=lambda ids: "".join(chr(ord("a") + i) for i in ids))  # 0 -> 'a', 1 -> 'b', ...


def _run(checker: StopChecker, ids, prompt_len: int = 1):
    """Feed ids one at a time -> (text, reason, tokens taken)."""
    text = ""
    for n, tok in enumerate(ids, 1):
        delta, reason = checker.add(tok, n, prompt_len + n)
        text += delta
        if reason is not None:
            return text, reason, n
    return text, None, len(ids)


def test_each_condition_in_order():
    p = SamplingParams(max_tokens=5, stop_token_ids=(3,))
    assert _run(StopChecker(p, eos_ids={2}), [0, 1, 2, 3])[1:] == ("stop", 3)  # end of sequence
    assert _run(StopChecker(p, eos_ids={2}), [0, 1, 3])[1:] == ("stop", 3)  # a stop token id
    ignoring = SamplingParams(max_tokens=5, ignore_eos=True)
    assert _run(StopChecker(ignoring, eos_ids={2}), [2, 2, 2, 2, 2, 2])[1:] == ("length", 5)  # max_tokens
    assert _run(StopChecker(p, max_model_len=4), [0, 1, 4, 4], prompt_len=2)[1:] == ("length", 2)  # the context
    assert _run(StopChecker(p), [0, 1, 4, 4])[1:] == (None, 4)


def test_stop_strings_cut_the_text_and_stop_at_the_token_completing_them():
    p = SamplingParams(max_tokens=10, stop=("cd",))
    checker = StopChecker(p, detok=Detokenizer(CHARS, p.stop))
    assert _run(checker, [0, 1, 2, 3, 4]) == ("ab", "stop", 4)  # 'c' is held until 'd' decides it
    none = StopChecker(SamplingParams(max_tokens=10), detok=Detokenizer(CHARS))
    assert _run(none, [0, 1, 2, 3, 4]) == ("abcde", None, 5)
