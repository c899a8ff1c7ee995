"""Row ids are time-ordered, and a forked process (a Celery worker child) never makes the
ids its parent or a sibling makes."""

import os

from config.ids import time_ordered_id

IDS = 50


def test_ids_sort_in_the_order_they_were_made():
    made = [time_ordered_id() for _ in range(1000)]

    assert made == sorted(made)
    assert {made_id.version for made_id in made} == {7}


def test_a_forked_process_makes_ids_of_its_own():
    time_ordered_id()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        os.write(write, "\n".join(str(time_ordered_id()) for _ in range(IDS)).encode())
        os._exit(0)
    os.close(write)
    mine = [str(time_ordered_id()) for _ in range(IDS)]
    os.waitpid(child, 0)
    with os.fdopen(read) as answer:
        theirs = answer.read().split("\n")

    # the random part (after the time and the version) of each id is the process's own
    assert len(theirs) == IDS
    assert not {made[15:] for made in mine} & {made[15:] for made in theirs}
