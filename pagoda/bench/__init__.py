"""`pagoda bench`: workloads, metrics and peers, as ../shared/BENCHMARKS.md defines them."""
