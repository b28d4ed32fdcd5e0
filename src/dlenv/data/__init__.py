"""Datasets: safe unpacking (`archive`), layout detection and the dataset report (`folder`), the
built-in demo dataset (`demo`), and datasets, transforms and DataLoaders (`loaders`)."""
