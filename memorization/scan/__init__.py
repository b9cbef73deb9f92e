"""`memorize scan`: a corpus-scale memorization scan, its sizing, its files and its report."""
