"""Subcommands of `git theta` contributed by this area; theta.cli calls register(app)."""
import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to the `git theta` app."""
