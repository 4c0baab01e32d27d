"""Test-wide settings. CI reruns must be reproducible: hypothesis draws the same examples each run
(set HYPOTHESIS_PROFILE=explore locally to search fresh ones)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
