"""AsyncEngine (the engine thread behind the HTTP server): shutting it down with requests in flight
ends each of their streams with an error saying so, instead of leaving the caller waiting."""
from __future__ import annotations

import asyncio

from heterollm import SamplingParams
from heterollm.config.loader import load_config
from heterollm.engine.async_engine import AsyncEngine, EngineError
from heterollm.engine.llm_engine import LLMEngine


def test_shutdown_ends_every_stream_in_flight_with_an_error(tiny_llama):
    engine = LLMEngine(load_config([], overrides={"model": str(tiny_llama), "dtype": "float32", "block_size": 8,
                                                   "num_gpu_blocks_override": 64, "max_model_len": 256}).config)
    runner = AsyncEngine(engine)
    runner.start()
    assert runner._thread.name == "heterollm-engine"  # what a stack dump or py-spy shows

    async def run():
        params = SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)
        streams = [await runner.add([5, 6, 7, i], params, f"r{i}") for i in range(2)]
        seen = []

        async def drain(stream):
            async for out in stream:
                seen.append(out)
                if len(seen) == 2:  # both are running: stop the engine under them
                    await asyncio.to_thread(runner.shutdown)
        # a stream the shutdown forgets would wait for ever: give up after a minute
        return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams), return_exceptions=True), 60)

    results = asyncio.run(run())
    assert [type(r) for r in results] == [EngineError, EngineError], results
    assert all(str(r) == "the engine shut down" for r in results)
    assert not runner.alive
