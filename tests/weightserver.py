"""A weights server on 127.0.0.1 for the pretrained tests: torchvision's file layout and the hub's.

`serve(root)` runs http.server in a thread over a folder that holds
  - torchvision files at /models/<name>-<sha256 prefix>.pth (what DLENV_TORCHVISION_URL points at), and
  - hub files at /<org>/<repo>/resolve/<rev>/<file>, answered with the headers huggingface_hub reads
    (X-Repo-Commit, ETag = the file's sha256 as for LFS files, X-Linked-Size).
Each request's path is recorded, so a test can tell a cache hit (no request) from a download.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import threading
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def torchvision_file(root: Path, stem: str, state: dict) -> Path:
    """Save `state` as torchvision names its files: <stem>-<first 8 hex of sha256>.pth, under root/models."""
    import torch

    folder = root / "models"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{stem}.tmp"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    path = folder / f"{stem}-{digest[:8]}.pth"
    tmp.replace(path)
    return path


def hub_file(root: Path, repo: str, state: dict, name: str = "model.safetensors") -> Path:
    """Save `state` as a hub repository's safetensors file under root/<repo>/resolve/main/."""
    from safetensors.torch import save_file

    folder = root / repo / "resolve" / "main"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send_head(self, body: bool):
        self.server.requests.append((self.command, self.path))
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = Path(self.server.root) / rel
        if not path.is_file():
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        if "/resolve/" in rel:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self):  # noqa: N802 (http.server's names)
        self._send_head(body=False)

    def do_GET(self):  # noqa: N802
        self._send_head(body=True)


@contextlib.contextmanager
def serve(root: Path):
    """(base URL, list of (method, path) requests) of a server over `root`, for the with-block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.root, server.requests = str(root), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests
    finally:
        server.shutdown()
        server.server_close()


def isolated_cache(monkeypatch, folder: Path) -> Path:
    """`folder` as the working folder, with no cache, offline or mirror setting of this machine's
    environment reaching the code under test; returns `folder`."""
    from dlenv.model import pretrained

    monkeypatch.chdir(folder)
    for k in ("TORCH_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", pretrained.OFFLINE_ENV,
              pretrained.MIRROR_ENV, "HF_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    return folder
