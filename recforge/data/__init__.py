"""Data: the canonical Parquet layout, converters, synthetic data, sequences and batches."""
