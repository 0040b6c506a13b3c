"""The README's API example runs as written (with a small prompt set and reward)."""
import pathlib
import re


def test_readme_api_example(tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## API in short\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = dict(prompts=[[1, 5, 6, 7, 8, 9, 3], [1, 4, 4, 3]],
                     my_reward=lambda prompt, output: float(len(output)))
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["ack"].version == 1 and int(namespace["state"].version) == 1
    assert (tmp_path / "runs" / "ckpt").is_dir()
