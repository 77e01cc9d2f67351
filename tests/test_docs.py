"""The docs name tests that exist, and every public symbol is documented."""

import glob
import os
import re

import towers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _docs():
  for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
    with open(path) as f:
      yield os.path.basename(path), f.read()


def test_every_test_named_in_the_docs_exists():
  named = 0
  for doc, text in _docs():
    for path, name in re.findall(r"`([\w/]+\.py)::(\w+)", text):
      named += 1
      candidates = [os.path.join(ROOT, "tests", path),
                    os.path.join(ROOT, "tests", "examples", path),
                    os.path.join(ROOT, path)]
      found = [c for c in candidates if os.path.exists(c)]
      assert found, "%s names %s, which does not exist" % (doc, path)
      with open(found[0]) as f:
        assert re.search(r"def %s\(" % name, f.read()), (
            "%s names %s::%s, which does not exist" % (doc, path, name))
  assert named > 20


def test_every_public_symbol_is_in_the_api_reference():
  with open(os.path.join(ROOT, "docs", "api.md")) as f:
    api = f.read()
  for name in towers.__all__ + ["__version__"]:
    assert "towers.%s" % name in api, name
  from towers import testing, training  # pylint: disable=g-import-not-at-top
  for name in training.__all__:
    assert "training.%s" % name in api, name
  for name in testing.__all__:
    assert "testing.%s" % name in api, name
