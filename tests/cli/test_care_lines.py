"""The care commands' text lines: one per problem, names from a hostile repository cannot drive the terminal."""
from theta.commands.fsck import problem_lines
from theta.model.fsck import Problem


def test_a_blob_needed_by_several_versions_is_one_line_naming_each():
    oid = "ab" * 32
    lines = problem_lines([Problem("missing", "model.pt", "main", "not in the local store", "w", oid, 2048),
                           Problem("missing", "model.pt", "HEAD~1", "not in the local store", "w", oid, 2048),
                           Problem("missing", "other.pt", "main", "not in the local store", "b", oid, 2048)])
    assert lines == [f"missing: blob {oid} (2.0 KiB): not in the local store; needed by model.pt group 'w' "
                     "(main, HEAD~1); other.pt group 'b' (main)"]


def test_control_characters_in_names_are_escaped():
    lines = problem_lines([Problem("metadata", "evil\x1b[2J\nmodel.pt", "index", "bad line\r", "g\x07")])
    assert lines == ["metadata: evil\\x1b[2J\\nmodel.pt (index) group 'g\\x07': bad line\\r"]
    assert all("\x1b" not in line and "\n" not in line for line in lines)
