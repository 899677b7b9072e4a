"""verl tests run on CPU: select the test-only CPU platform before anything imports verl (its platform is a
cached singleton) and make the cuda engine entry the one EngineRegistry returns."""

import os
import sys

os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"
os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")
sys.path.insert(0, os.path.dirname(__file__))
