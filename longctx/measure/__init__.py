"""Measuring tools, used by the tests and the benchmarks alike:

    meter.py         what autograd keeps for backward, per layer (`SavedTensorMeter`), and live bytes (`LiveBytes`)
    peak.py          where in a step the CUDA memory peak happens, and what is alive then
    decode_drift.py  how far the decode path is from the training forward on the same tokens
"""
