import sys
import pathlib

# workers.py and harness.py are imported by name, as the worker processes import them.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
