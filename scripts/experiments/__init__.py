"""The seeds' experiments (issue #12): each writes results/<name>/ and takes --smoke.
``python -m scripts.experiments.run_experiments`` runs them all and writes results/SUMMARY.md and CLAIMS.md."""
