"""`POST /start_profile` and `POST /stop_profile` (`--enable_online_profile`, xLLM's online timeline
interface): every replica's ranks record what they run between the two calls and write one trace per
rank into `--profile_dir` (the working directory by default), to open in Perfetto."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from heterollm.engine.async_engine import EngineError
from heterollm.scheduler.request import RequestRejected


class ProfileRoutes:
    def __init__(self, server: Any) -> None:
        self.server = server

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/start_profile", self.start_profile, methods=["POST"])
        app.add_api_route("/stop_profile", self.stop_profile, methods=["POST"])

    async def start_profile(self) -> Response:
        return await self._on_every_replica("start_profile", lambda _: {"status": "started"})

    async def stop_profile(self) -> Response:
        return await self._on_every_replica("stop_profile",
                                            lambda results: {"status": "stopped",
                                                             "traces": [f for r in results for f in r]})

    async def _on_every_replica(self, method: str, answer: Any) -> Response:
        server = self.server
        if not server.engine.config.profile.enable_online_profile:
            return server._error(400, "online profiling needs the server started with --enable_online_profile",
                                 "enable_online_profile")
        try:
            results = [await replica.utility(method) for replica in server.replicas]
        except RequestRejected as exc:
            return server._error(400, str(exc), exc.field)
        except EngineError as exc:
            return server._error(503, str(exc))
        return JSONResponse(answer(results))
