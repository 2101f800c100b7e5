"""Results: pulled runs read from disk and compared (compare: names, comparability, the comparison), their
headline numbers' intervals and paired comparisons (intervals) and the statistics under them (stats)."""
