"""Every command that binds a port says in one line when the port is in use, and that
``--port 0`` picks a free one; ``voltrl model serve`` says so before it loads the model."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from voltrl.cli import main


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--store", "memory"],
        ["gateway", "--store", "http://127.0.0.1:9", "--backend", "http://127.0.0.1:9/v1"],
        ["dashboard", "."],
        ["model", "serve", "tiny", "--threads", "1"],
    ],
    ids=["serve", "gateway", "dashboard", "model serve"],
)
def test_a_port_in_use_is_one_line_suggesting_port_0(command, taken, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the dashboard's source: a directory of runs (none yet)
    status = main([*command, "--port", taken])
    out, err = capsys.readouterr()
    assert status == 2, err
    assert err == (
        f"voltrl: error: cannot listen on 127.0.0.1:{taken}: the port is in use "
        "(--port 0 picks a free one)\n"
    )
    assert "voltrl model serve: model" not in out


def _answer(task: dict, llm: object) -> float:
    return 0.0


def test_a_trainer_whose_store_port_is_in_use_says_so_in_one_line(taken, tmp_path):
    import voltrl as vl

    trainer = vl.Trainer(n_runners=1, run_dir=tmp_path, port=int(taken), progress=False)
    with pytest.raises(vl.VoltRLError) as caught:
        trainer.dev(_answer, [{"x": 1}])
    assert str(caught.value) == (
        f"cannot listen on 127.0.0.1:{taken}: the port is in use (port 0 picks a free one)"
    )
