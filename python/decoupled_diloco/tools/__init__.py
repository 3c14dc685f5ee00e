"""The project's command-line tooling, one module per command (each has `main(argv=None) -> int`
and an entry point in pyproject.toml; the repository's wrappers in scripts/ and bench/ run them):

- run_local: the local cluster (`scripts/run-local`, `diloco-run-local`)
- report: plots and a page of a run folder (`scripts/report`, `diloco-report`)
- chaos: the cluster under a seeded failure schedule (`scripts/chaos`, `diloco-chaos`)
- wan_sim: the cluster with regions behind rate-limited links (`scripts/wan-sim`, `diloco-wan-sim`)
- bench_quality, bench_wan, bench_link_cut, bench_chaos, bench_session_overhead: the benchmarks
  (`bench/quality`, `bench/wan`, `bench/link-cut`, `bench/chaos`, `bench/session_overhead`;
  `diloco-bench-*`)
"""
