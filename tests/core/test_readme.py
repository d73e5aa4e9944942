"""The README stays a user's path: about 200 lines, the two commands (demo and all tests) and no other setup command,
the one-flag line, the preprint cited, the status line's link to the what-ran matrix."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_readme_keeps_its_contract():
    text = open(README, encoding="utf-8").read()
    assert len(text.splitlines()) <= 220
    commands = re.findall(r"^pip install nox && nox .*$", text, re.M)
    assert [c.split("#")[0].strip() for c in commands] == ["pip install nox && nox -s demo",
                                                           "pip install nox && nox -t tests"]
    assert "`faircast: true`" in text
    assert ('"bf16 Rounding Silently Discards Most RL Policy Updates: A Hidden Training-Inference Mismatch and an '
            'Unbiased One-Line Fix" (Andrew Gao and William Gao)') in " ".join(text.split())
    status = text.split("## ")[0]
    assert "not on PyPI" in status and "(docs/what-ran.md)" in status
    assert "faircast estimate --checkpoint" in text and "faircast export --checkpoint" in text
