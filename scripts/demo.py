"""The main job. Until theta lands this is a zipslice demo; it grows into the theta versioning demo."""
import sys

print("zipslice/theta: the demo is being built; see README.md", file=sys.stderr)
