"""The example tests import the example scripts' modules from examples/."""

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
