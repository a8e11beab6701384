"""Simulated Ascend inference engine: a real HTTP server (OpenAI API + vLLM /metrics) over a
continuous-batching physics model, with admin-injected faults and a simulated npu-smi.

Modules: profiles (chip data), physics (pure batching model), openai_api (wire format),
metrics (vLLM Prometheus metrics), driver (asyncio stepping task), config (settings and fault
state), app (aiohttp), npu_smi (simulated npu-smi), cli (`laswrr sim-engine`, `sim-npu-smi`).
"""
