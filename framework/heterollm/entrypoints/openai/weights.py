"""`POST /update_weights` (`--dynamic_load_weight 1`): new weights for the running engine, from a
path on the server's host (`{"path": "/models/step-1200"}`: a folder of *.safetensors, or one file)
or sent in the body (`Content-Type: application/octet-stream`: a safetensors file, which may hold
only the parameters that changed). Every replica reloads between two of its steps; requests in
flight go on with the new weights, and the prefix cache is emptied."""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from heterollm.engine.async_engine import EngineError
from heterollm.model_executor.weight_update import WeightUpdate, WeightUpdateError
from heterollm.scheduler.request import RequestRejected


class WeightRoutes:
    def __init__(self, server: Any) -> None:
        self.server = server

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/update_weights", self.update_weights, methods=["POST"])

    async def update_weights(self, request: Request) -> Response:
        server = self.server
        if not server.engine.config.fastdeploy.dynamic_load_weight:
            return server._error(400, "reloading weights needs the server started with --dynamic_load_weight 1",
                                 "dynamic_load_weight")
        try:
            update = self._update(request.headers.get("content-type", ""), await request.body())
            results = []
            for replica in server.replicas:  # one at a time: a failure leaves the others as they were
                results.append(await replica.utility("update_weights", update))
        except (WeightUpdateError, RequestRejected) as exc:
            return server._error(400, str(exc), exc.field)
        except EngineError as exc:
            return server._error(503, str(exc))
        return JSONResponse({"tensors": results[0]["tensors"], "replicas": len(results),
                             "seconds": round(max(r["seconds"] for r in results), 3)})

    @staticmethod
    def _update(content_type: str, body: bytes) -> WeightUpdate:
        if content_type.startswith("application/octet-stream"):
            if not body:
                raise WeightUpdateError("body", "the body is empty; send a safetensors file")
            return WeightUpdate(payload=body)
        try:
            fields = json.loads(body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightUpdateError("body", f"the body is not JSON ({exc}); send {{\"path\": ...}}, or a safetensors "
                                            "file as application/octet-stream") from None
        path = fields.get("path") if isinstance(fields, dict) else None
        if not isinstance(path, str) or not path:
            raise WeightUpdateError("path", "path must be a non-empty string: a folder of *.safetensors or one file "
                                            "on the server's host")
        return WeightUpdate(path=path)
