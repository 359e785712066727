"""The command line's helpers: the one policy for the files commands write
(attnscore.cli._files), the usage-error parser and the option types (attnscore.cli._usage)."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys

import pytest
import torch
from matplotlib.figure import Figure

from attnscore.cli._files import (
    FIGURE_FORMATS,
    check_folder,
    check_output,
    save_figure,
    write_atomic,
)
from attnscore.cli._usage import (
    ArgumentParser,
    UsageError,
    default_device,
    device_arg,
    optional_package,
    positive_int,
    require_extra,
    run_main,
)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def test_check_output_accepts_and_refuses(tmp_path):
    assert check_output(tmp_path / "a.PDF", "--x", FIGURE_FORMATS) == tmp_path / "a.PDF"
    with pytest.raises(UsageError, match=r"^--x: .* is a folder; expected a file name$"):
        check_output(tmp_path, "--x", FIGURE_FORMATS)
    with pytest.raises(UsageError, match=r"^--x: expected a file ending in \.npz, but got a\.txt$"):
        check_output(tmp_path / "a.txt", "--x", (".npz",))
    with pytest.raises(UsageError, match=r"^--x: folder .*/gone does not exist; create it first$"):
        check_output(tmp_path / "gone" / "a.png", "--x", FIGURE_FORMATS)
    assert not (tmp_path / "gone").exists()


def test_check_output_refuses_an_existing_file_unless_overwrite(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(b"mine")
    exists = f"^--x: {re.escape(str(path))} exists; pass --overwrite to replace it$"
    with pytest.raises(UsageError, match=exists):
        check_output(path, "--x", FIGURE_FORMATS)
    assert check_output(path, "--x", FIGURE_FORMATS, overwrite=True) == path
    link = tmp_path / "link.png"
    link.symlink_to(tmp_path / "nowhere")  # a dangling link is there too
    with pytest.raises(UsageError, match=r"link\.png exists; pass --overwrite"):
        check_output(link, "--x", FIGURE_FORMATS)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)  # never replaced, even with --overwrite
    with pytest.raises(UsageError, match=r"fifo\.png is not a regular file; expected a file name$"):
        check_output(fifo, "--x", FIGURE_FORMATS, overwrite=True)
    with pytest.raises(UsageError, match=r"^--x: .*/a\.png is a file, not a folder$"):
        check_output(path / "b.png", "--x", FIGURE_FORMATS)
    assert path.read_bytes() == b"mine"


def test_check_folder(tmp_path):
    assert check_folder(tmp_path / "new", "--out") == tmp_path / "new"
    assert not (tmp_path / "new").exists()  # checked, not made
    with pytest.raises(UsageError, match=r"^--out: folder .*/no does not exist; create it first$"):
        check_folder(tmp_path / "no" / "new", "--out")
    assert check_folder(tmp_path / "no" / "new", "--out", parents=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match=r"^--out: .*/f is a file; expected a folder$"):
        check_folder(tmp_path / "f", "--out", overwrite=True)
    with pytest.raises(UsageError, match=r"^--out: .*/f is a file, not a folder$"):
        check_folder(tmp_path / "f" / "a" / "b", "--out", parents=True)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "t.md").write_text("mine")
    (tmp_path / "d" / "sub.png").mkdir()
    assert check_folder(tmp_path / "d", "--out", files=["other.md"]) == tmp_path / "d"
    with pytest.raises(UsageError, match=r"^--out: .*/d/t\.md exists; pass --overwrite to rep"):
        check_folder(tmp_path / "d", "--out", files=["other.md", "t.md"])
    assert check_folder(tmp_path / "d", "--out", files=["t.md"], overwrite=True)
    with pytest.raises(UsageError, match=r"^--out: .*/d/sub\.png is a folder; expected a file"):
        check_folder(tmp_path / "d", "--out", files=["sub.png"], overwrite=True)


def test_write_atomic_never_replaces_a_file_made_after_the_check(tmp_path):
    path = tmp_path / "f.bin"

    def write(f):
        path.write_bytes(b"theirs")  # appears while the command works
        f.write(b"mine")

    with pytest.raises(UsageError, match=r"^--x: .*f\.bin exists; pass --overwrite to replace"):
        write_atomic(path, write, "--x")
    assert path.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    write_atomic(path, lambda f: f.write(b"new"), "--x", overwrite=True)
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_write_atomic_without_hard_links(tmp_path, monkeypatch):
    """On a file system without hard links the new file is renamed into place, and an
    existing one is still refused."""

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "f.bin"
    write_atomic(path, lambda f: f.write(b"one"), "--x")
    assert path.read_bytes() == b"one"
    with pytest.raises(UsageError, match="exists; pass --overwrite"):
        write_atomic(path, lambda f: f.write(b"two"), "--x")
    assert path.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_run_main_reports_usage_errors_and_missing_extras(capsys):
    def usage():
        raise UsageError("--x: bad\n  value")

    assert run_main("prog", usage) == 2
    assert capsys.readouterr().err == "prog: error: --x: bad value\n"

    def extra():
        try:
            import entmax  # noqa: F401
        except ImportError as err:  # as the library re-raises it, with its own message
            raise ImportError("normalizer='sparsemax' needs entmax") from err
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "entmax", None)
        assert run_main("prog", extra) == 2
        with pytest.raises(UsageError, match=r"^--n: needs the optional package entmax, .*or so$"):
            require_extra("entmax", "--n", otherwise=", or so")
    assert capsys.readouterr().err == (
        "prog: error: the optional package entmax cannot be imported; install it with: "
        'pip install "attnscore[entmax]"\n'
    )
    assert optional_package(ImportError("x", name="onnxscript.values")) == "onnxscript"
    assert optional_package(ImportError("x", name="numpy")) is None

    def bug():
        raise ImportError("a bug, not a missing extra", name="attnscore.nothing")

    with pytest.raises(ImportError, match="a bug"):
        run_main("prog", bug)


def test_run_main_closed_stdout_is_quiet(capsys):
    def closed():
        raise BrokenPipeError(32, "Broken pipe")

    assert run_main("prog", closed) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o000, 0o666)])
def test_write_atomic_mode_follows_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    path = tmp_path / "f.bin"
    write_atomic(path, lambda f: f.write(b"data"), "--x")
    assert path.read_bytes() == b"data"
    assert stat.S_IMODE(path.stat().st_mode) == mode
    # The same as a file opened the ordinary way.
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert stat.S_IMODE(plain.stat().st_mode) == mode


def test_write_atomic_failure_leaves_nothing_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError, match=r"^--x: cannot write .*f\.bin: No space left on device$"):
        write_atomic(path, fail, "--x")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]

    def bug(f):
        raise RuntimeError("a bug, not the user's fault")

    with pytest.raises(RuntimeError):
        write_atomic(path, bug, "--x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_write_atomic_missing_folder(tmp_path):
    with pytest.raises(UsageError, match="--x: cannot write"):
        write_atomic(tmp_path / "gone" / "f", lambda f: f.write(b""), "--x")
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".png", b"\x89PNG"), (".pdf", b"%PDF-"), (".svg", b"<?xml")]
)
def test_save_figure_writes_the_format_its_extension_names(tmp_path, suffix, magic):
    fig = Figure()
    fig.subplots().plot([0, 1])
    path = tmp_path / f"f{suffix}"
    save_figure(fig, path, "--heatmap")
    assert path.read_bytes().startswith(magic)


def test_save_figure_refuses_other_formats(tmp_path):
    with pytest.raises(
        UsageError, match=r"--heatmap: expected a file ending in .png, .pdf or .svg"
    ):
        save_figure(Figure(), tmp_path / "f.jpg", "--heatmap")
    assert list(tmp_path.iterdir()) == []


def test_device_arg(monkeypatch):
    assert device_arg("cpu") == "cpu"
    with pytest.raises(
        UsageError, match=r"^--device: expected cpu, cuda or cuda:N, but got 'tpu'$"
    ):
        device_arg("tpu")
    with pytest.raises(UsageError, match="expected cpu, cuda or cuda:N"):
        device_arg("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"^--device: CUDA was asked for, but no GPU is available"):
        device_arg("cuda")
    assert default_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_arg("cuda:0") == "cuda:0" and default_device() == "cuda"
    with pytest.raises(UsageError, match=r"expected a GPU index below 1, but got 'cuda:3'"):
        device_arg("cuda:3")


def test_positive_int_in_a_parser():
    parser = ArgumentParser(prog="x")
    parser.add_argument("--n", type=positive_int)
    assert parser.parse_args(["--n", "3"]).n == 3
    for bad in ("0", "-3", "2.5", "many"):
        with pytest.raises(
            UsageError, match=f"argument --n: expected a positive integer, but got '{bad}'"
        ):
            parser.parse_args(["--n", bad])
    assert isinstance(parser, argparse.ArgumentParser)


def test_subparsers_share_the_convention():
    parser = ArgumentParser(prog="x")
    sub = parser.add_subparsers(dest="cmd", required=True)
    child = sub.add_parser("child")
    child.add_argument("--k", type=int)
    assert type(child) is ArgumentParser
    with pytest.raises(UsageError, match="invalid int value"):
        parser.parse_args(["child", "--k", "x"])
