"""The Horovod build's patches (`scripts/patch_horovod.py`): they apply to the sdist's text,
stop the install when the text moved, and the Horovod this venv runs carries them."""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from tests.support.paths import ROOT

_spec = importlib.util.spec_from_file_location("patch_horovod", ROOT / "scripts/patch_horovod.py")
patch_horovod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch_horovod)

PAIR_CC = """ssize_t Pair::prepareRead(...) {
  if (opcode == Op::SEND_UNBOUND_BUFFER) {
    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    if (!buf) {
      return -1;
    }
  }
}
void Pair::handleRemotePendingRecv(const Op& op) {
    if (queue.empty()) {
      localPendingSend_.erase(it);
    }
    sendUnboundBuffer(std::move(buf), slot, offset, nbytes);
    return;
}
bool Pair::write(Op& op) {
    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    if (!buf) {
      return false;
    }
}
"""


def _sdist(tmp_path, pair_cc: str = PAIR_CC):
    (tmp_path / "horovod/torch").mkdir(parents=True)
    (tmp_path / "third_party/gloo/gloo/transport/tcp").mkdir(parents=True)
    for cmake in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        (tmp_path / cmake).write_text("project(x)\nset(CMAKE_CXX_STANDARD 14)\n")
    (tmp_path / "third_party/gloo/gloo/transport/tcp/pair.cc").write_text(pair_cc)
    return tmp_path


def test_a_dead_buffer_closes_the_pair_on_either_side_and_cxx17_is_asked(tmp_path):
    src = _sdist(tmp_path)
    patch_horovod.main(str(src))
    pair = (src / "third_party/gloo/gloo/transport/tcp/pair.cc").read_text()
    read_side, rest = pair.split("void Pair::handleRemotePendingRecv")
    send_side, write = rest.split("bool Pair::write")
    assert read_side.index("signalException") < read_side.index("return -1;")
    assert patch_horovod.MESSAGES[0] in read_side
    assert send_side.index("signalException") < send_side.index("sendUnboundBuffer")
    assert patch_horovod.MESSAGES[1] in send_side
    assert "signalException" not in write  # left as it was
    assert "CMAKE_CXX_STANDARD 17" in (src / "horovod/torch/CMakeLists.txt").read_text()


def test_a_moved_text_stops_the_install_naming_the_file(tmp_path):
    src = _sdist(tmp_path, PAIR_CC.replace("return -1;", "return -2;"))
    with pytest.raises(SystemExit, match="pair.cc, found 0"):
        patch_horovod.main(str(src))


def test_the_installed_horovod_carries_the_gloo_patch():
    import horovod.torch

    libs = glob.glob(os.path.join(os.path.dirname(horovod.torch.__file__), "mpi_lib_v2*.so"))
    assert libs, "no Horovod torch library found"
    with open(libs[0], "rb") as f:
        lib = f.read()
    for message in patch_horovod.MESSAGES:
        assert message.encode() in lib, \
            "this venv's Horovod was built without scripts/patch_horovod.py: run make install"
