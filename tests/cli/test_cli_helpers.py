"""The command line's helpers: the one policy for the files commands write
(attnscore.cli._files), the usage-error parser and the option types (attnscore.cli._usage)."""

from __future__ import annotations

import argparse
import os
import stat

import pytest
import torch
from matplotlib.figure import Figure

from attnscore.cli._files import FIGURE_FORMATS, check_output, save_figure, write_atomic
from attnscore.cli._usage import (
    ArgumentParser,
    UsageError,
    default_device,
    device_arg,
    positive_int,
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
