"""A KV pool's snapshot drawn as a block map: one cell per physical block, by owner and state.

The drawing behind experiments/block_map_movie.py and the tour notebook's block map of
a live engine (the snapshot is engine/pool_snapshot.py's, the same the server's
/dashboard draws in the browser). Blocks held by one request take that request's colour
(stable per request id, so a request keeps its colour from frame to frame and across
allocators); a contiguous reservation's blocks not yet written take a pale version of it
(reservation waste); shared blocks (forks, prefix-cache hits) are orange, free blocks
the prefix cache still holds pale green, free blocks in a gap too short for the next
waiting request (external fragmentation) pink, other free blocks light grey, and the
null block black.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

FREE = (0.91, 0.92, 0.93)
SHARED = (0.96, 0.52, 0.09)
CACHED = (0.65, 0.86, 0.63)
FRAGMENT = (0.96, 0.65, 0.65)
NULL = (0.2, 0.2, 0.2)
RESERVED_TINT = 0.6  # a reserved block: its owner's colour this far towards white
STATE_COLORS = {"free": FREE, "shared": SHARED, "cached": CACHED, "fragment": FRAGMENT, "null": NULL}
LEGEND = [("used (one colour per request)", (0.12, 0.47, 0.71)), ("reserved, not yet written", None),
          ("shared", SHARED), ("free, still cached", CACHED), ("free fragment", FRAGMENT), ("free", FREE)]


# owners' colours: blues, teals, purples, browns and olives, none of them the states' orange,
# green, pink or grey, so that a request's block never reads as shared, cached or free
OWNER_COLORS = ("#1f77b4", "#17becf", "#9467bd", "#8c564b", "#bcbd22", "#2f4b7c", "#4c9f9f", "#665191",
                "#a0785a", "#6b8e23", "#3a6ea5", "#7f5fa8")


def owner_color(request_id: str) -> tuple[float, float, float]:
    """A request's colour: one of OWNER_COLORS, chosen by a hash of its id."""
    from matplotlib.colors import to_rgb
    return to_rgb(OWNER_COLORS[zlib.crc32(request_id.encode()) % len(OWNER_COLORS)])


def grid_columns(num_blocks: int, aspect: float = 2.0) -> int:
    """Columns for a grid about `aspect` times wider than tall."""
    return max(1, math.ceil(math.sqrt(num_blocks * aspect)))


def block_map_image(snapshot: dict, columns: int | None = None) -> np.ndarray:
    """float[rows, columns, 3]: the snapshot's device blocks in id order, row by row
    (cells past the last block white)."""
    states, names = snapshot["blocks"], snapshot["states"]
    owners: dict[int, str] = {}
    for request in snapshot["requests"]:
        for seq in request["seqs"]:
            if seq["on_host"]:
                continue
            start, length = seq.get("reservation") or (0, 0)  # contiguous: the whole run
            for block in [*seq["blocks"], *range(start, start + length)]:
                owners.setdefault(block, request["request_id"])
    columns = columns or grid_columns(len(states))
    rows = math.ceil(len(states) / columns)
    image = np.ones((rows * columns, 3))
    for block, code in enumerate(states):
        name = names[ord(code) - 48]
        if name in ("used", "reserved") and block in owners:
            color = np.array(owner_color(owners[block]))
            image[block] = color if name == "used" else color + (1 - color) * RESERVED_TINT
        else:
            image[block] = STATE_COLORS.get(name, FREE)
    return image.reshape(rows, columns, 3)


def draw_block_map(ax, snapshot: dict, *, columns: int | None = None, title: str | None = None):
    """Draw the snapshot's block map on a matplotlib axis; returns the AxesImage."""
    shown = ax.imshow(block_map_image(snapshot, columns), interpolation="nearest", aspect="equal")
    ax.set_xticks([])
    ax.set_yticks([])
    if title is not None:
        ax.set_title(title, fontsize=9)
    return shown


def caption(snapshot: dict) -> str:
    """One line of counters under a map: sequences, blocks used, utilization, waste."""
    c = snapshot["counters"]
    waste = c["waste_internal_slots"] + c["waste_reservation_slots"] + c["waste_external_slots"]
    slots = c["num_blocks_total"] * snapshot["block_size"]
    return (f"{c['num_running']} running, {c['num_waiting']} waiting; {c['num_blocks_used']}/{c['num_blocks_total']} "
            f"blocks held; tokens {100 * c['kv_utilization']:.0f}% of slots; waste {100 * waste / slots:.0f}%")


def add_legend(fig) -> None:
    """The colours' legend along the figure's bottom edge."""
    from matplotlib.patches import Patch
    pale = tuple(c + (1 - c) * RESERVED_TINT for c in LEGEND[0][1])
    handles = [Patch(facecolor=color if color is not None else pale, edgecolor="0.6", label=label)
               for label, color in LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
