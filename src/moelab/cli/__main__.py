"""``python -m moelab.cli`` (what ``torchrun -m moelab.cli`` runs)."""

from moelab.cli import main

main()
