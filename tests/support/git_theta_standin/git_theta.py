"""theta standing in for Git-Theta's package in Git-Theta's in-process end-to-end test (its test.py does
``import git_theta`` and calls ``git_theta.save_to_git`` / ``git_theta.load_from_git``): ``git_theta`` is
``theta`` itself, so the test exercises theta's functions of those names and signatures."""
import sys

import theta

sys.modules[__name__] = theta
