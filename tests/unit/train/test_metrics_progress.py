"""Progress output under launchers: a pipe gets plain lines, never tqdm's carriage returns."""

from __future__ import annotations

import io

from hvrep.train.metrics import LineProgress, MetricsWriter


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_a_piped_stderr_gets_one_line_every_n_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", _Pipe())
    writer = MetricsWriter(tmp_path, enabled=True)
    bar = writer.progress(total=25, initial=0, desc="epoch 1/3", every=10)
    assert isinstance(bar, LineProgress)
    for _ in range(25):
        bar.update(1)
        bar.set_postfix(loss="0.500", img_s="100")
    bar.close()
    writer.close()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("epoch 1/3")]
    assert [line.split(" (")[0] for line in lines] == ["epoch 1/3: step 10/25", "epoch 1/3: step 20/25",
                                                       "epoch 1/3: step 25/25"], out
    assert "loss=0.500" in lines[-1] and "\r" not in out
    assert "\r" not in __import__("sys").stderr.getvalue()


def test_other_ranks_print_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", _Pipe())
    bar = MetricsWriter(tmp_path, enabled=False).progress(total=5, initial=0, desc="epoch 1/1")
    for _ in range(5):
        bar.update(1)
    bar.close()
    assert capsys.readouterr().out == ""
