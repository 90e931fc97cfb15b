"""``pagewire bench``: a load generator measured at the client, with Hugging Face baselines.

- :mod:`pagewire.bench.metrics`: metric definitions (TTFT, TPOT, ITL, E2E, throughput) as pure functions
- :mod:`pagewire.bench.loadgen`: prompts, arrival schedules and the asyncio gRPC client
- :mod:`pagewire.bench.baselines`: transformers ``generate`` (static batches) and continuous batching
- :mod:`pagewire.bench.report`: summary table, JSON document, latency plot
- :mod:`pagewire.bench.server`: starting and stopping the server that ``--serve`` measures
- :mod:`pagewire.bench.cli`: the ``bench`` subcommand
"""
