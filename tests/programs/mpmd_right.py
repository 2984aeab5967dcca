"""Program "right" of a two-script MPMD job (see tests/programs/mpmd_left.py)."""
import mpmd_common

mpmd_common.main("right", "left")
