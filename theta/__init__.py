"""theta: version ML checkpoints in git parameter group by parameter group, with groups stored in Git LFS."""
__version__ = "0.1.0"
