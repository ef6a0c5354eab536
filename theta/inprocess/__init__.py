"""Commits from Python: :mod:`theta.inprocess.commit` (save_to_git, load_from_git) and the Hugging Face Trainer
callback (:mod:`theta.inprocess.trainer`)."""
