"""Performance over time: the nightly history of the perf goldens (`history`), its page (`page`), the peers'
trend (`peer_trend`) and the Markdown tables of a pytest-benchmark run (`table`, `mhc-harness perf-table`)."""
