"""Benchmark clients and peer launchers, never imported by the server (``serving``): the streaming load client
and its rows and multi-turn workload (``load_client``, ``load_rows``, ``load_chat``), server processes for
benchmarks and tests (``launch``), llama.cpp (``llama_cpp_build``, ``llama_cpp``, ``llama_peer``) and vLLM
(``vllm_peer``; ``vllm_lookup``, the engine's context lookup as vLLM's proposer, imported by vLLM's worker).
Imports nothing itself: vLLM's worker imports ``peers.vllm_lookup`` with ``engine.lookup``'s light
dependencies only."""
