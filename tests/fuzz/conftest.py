"""tests/fuzz holds fuzz targets and their runner (``make fuzz``), not tests: pytest collects
nothing here. The CI slice that runs every target briefly is tests/unit/test_fuzz_slice.py."""

collect_ignore_glob = ["*.py"]
