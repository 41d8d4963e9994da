"""Command-line entry points and launcher helpers."""
