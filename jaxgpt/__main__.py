import sys

from jaxgpt.cli import main

sys.exit(main())
