"""theta: version ML checkpoints in git parameter group by parameter group, with groups stored in Git LFS."""


def __getattr__(name: str):
    if name == "__version__":  # one version for the distribution (zipslice-theta), read on first use
        from zipslice.version import package_version

        return package_version()
    raise AttributeError(f"module 'theta' has no attribute {name!r}")
