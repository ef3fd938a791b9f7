"""A reward module that imports in the main process and ends any worker process that imports it."""

import multiprocessing
import os

if multiprocessing.parent_process() is not None:
    os._exit(5)


def score(messages, row):
    return 1.0
