"""Program "left" of a two-script MPMD job (with tests/programs/mpmd_right.py):

    mpiexec -n L python tests/programs/mpmd_left.py : -n R python tests/programs/mpmd_right.py
"""
import mpmd_common

mpmd_common.main("left", "right")
