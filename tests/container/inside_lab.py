"""A JupyterLab client that runs *inside* a container (tests/container/test_lab_and_tensorboard.py sends this file's
text to `python -c` through `docker exec`): with networking off, the lab is reachable only on the
container's own loopback.

    python -c "$(cat inside_lab.py)" PORT TOKEN

Through the server's REST API: its status, its root folder's listing and its default kernel; then a
kernel started through REST, driven over the websocket (Jupyter's JSON message protocol), imports torch
and dlenv and runs one training step of dlenv's small CNN; the kernel is shut down through REST. Prints
one JSON object: what the server and the kernel said. Only the standard library and tornado (which
Jupyter's server runs on) are used.
"""

import asyncio
import json
import sys
import time
import urllib.request
import uuid

CODE = """
import json, sys
import torch, dlenv
from dlenv import Precision, build_model
torch.manual_seed(0)
model = build_model("small_cnn", num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
precision = Precision("fp32", torch.device("cpu"))
x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
with precision.autocast():
    loss = torch.nn.functional.cross_entropy(model(x), y)
before = [p.detach().clone() for p in model.parameters()]
precision.backward(loss)
precision.step(opt)
moved = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
print(json.dumps({"prefix": sys.prefix, "torch": torch.__version__, "dlenv": dlenv.__version__,
                  "loss": loss.item(), "params_moved": moved}))
"""


def api(port: int, token: str, path: str, method: str = "GET", body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return json.loads(text) if text else None


def wait_for_server(port: int, token: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        try:
            return api(port, token, "/api/status")
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)


async def execute(port: int, token: str, kernel_id: str, code: str, timeout: float = 300) -> dict:
    """Run `code` in the kernel over its websocket; return its stdout, stderr, errors and reply status."""
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?token={token}")
    msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": session, "username": "test",
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    out = {"stdout": "", "stderr": "", "error": None, "reply": None}
    idle = False
    deadline = time.time() + timeout
    while out["reply"] is None or not idle:
        raw = await asyncio.wait_for(ws.read_message(), timeout=max(1.0, deadline - time.time()))
        if raw is None:
            raise RuntimeError("the kernel's websocket closed")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out[content["name"]] += content["text"]
        elif kind == "error":
            out["error"] = f"{content['ename']}: {content['evalue']}"
        elif kind == "execute_reply":
            out["reply"] = content["status"]
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    ws.close()
    return out


def main(port: int, token: str) -> dict:
    said = {"status": wait_for_server(port, token)}
    said["root_listing"] = sorted(item["name"] for item in api(port, token, "/api/contents")["content"])
    specs = api(port, token, "/api/kernelspecs")
    said["default_kernel"] = specs["default"]
    said["kernel_argv"] = specs["kernelspecs"][specs["default"]]["spec"]["argv"]
    kernel = api(port, token, "/api/kernels", "POST", {"name": specs["default"]})
    try:
        said["run"] = asyncio.run(execute(port, token, kernel["id"], CODE))
    finally:
        api(port, token, f"/api/kernels/{kernel['id']}", "DELETE")
    said["kernels_left"] = len(api(port, token, "/api/kernels"))
    return said


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
