"""Tools for kernel developers (not installed): run from the repository root, `python -m tools.<tool>`."""
