"""`memorize compare REF RUN...`: per-document paired tests of runs that scored the same documents."""
from memorization.compare.command import cmd_compare, compare_folders

__all__ = ["cmd_compare", "compare_folders"]
