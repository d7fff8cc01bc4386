"""Writes tests/fixtures/agent-session.json (python3 make_agent_session.py OUT): a coding
agent's session in Anthropic's Messages shape (a long system prompt in blocks, 32 tools, 20
turns with parallel tool calls). Seeded: the same file every time."""
import json, random, sys

random.seed(7)

def schema(props, required):
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

S = lambda d: {"type": "string", "description": d}
I = lambda d: {"type": "integer", "description": d}
B = lambda d: {"type": "boolean", "description": d}
A = lambda d: {"type": "array", "items": {"type": "string"}, "description": d}

tools = [
 ("Bash", "Runs a shell command in the project's working directory and returns its output. Use it for builds, tests and git; prefer the dedicated tools for reading and searching files.", schema({"command": S("The command to run"), "timeout": I("Milliseconds before the command is stopped (at most 600000)"), "description": S("What the command does, in five to ten words")}, ["command"])),
 ("Read", "Reads a file from the local filesystem, with line numbers. Reads up to 2000 lines from the start unless an offset and a limit are given.", schema({"file_path": S("The absolute path of the file"), "offset": I("The line to start at"), "limit": I("How many lines to read")}, ["file_path"])),
 ("Write", "Writes a file to the local filesystem, replacing it if it exists. Read a file before overwriting it.", schema({"file_path": S("The absolute path of the file"), "content": S("The content to write")}, ["file_path", "content"])),
 ("Edit", "Replaces exact text in a file. The old text must be unique in the file unless replace_all is set.", schema({"file_path": S("The absolute path of the file"), "old_string": S("The text to replace"), "new_string": S("The text to put in its place"), "replace_all": B("Replace every occurrence")}, ["file_path", "old_string", "new_string"])),
 ("MultiEdit", "Makes several edits to one file in one operation, each as Edit makes it, in order; all or none are applied.", schema({"file_path": S("The absolute path of the file"), "edits": {"type": "array", "items": schema({"old_string": S("The text to replace"), "new_string": S("Its replacement")}, ["old_string", "new_string"])}}, ["file_path", "edits"])),
 ("Glob", "Finds files by a glob pattern such as src/**/*.rs, newest first.", schema({"pattern": S("The glob pattern"), "path": S("The directory to search in")}, ["pattern"])),
 ("Grep", "Searches file contents with a regular expression (ripgrep syntax) and lists the matching files or lines.", schema({"pattern": S("The regular expression"), "path": S("Where to search"), "glob": S("Only files matching this glob"), "output_mode": S("content, files_with_matches or count"), "-n": B("Show line numbers")}, ["pattern"])),
 ("LS", "Lists the files and directories in a directory.", schema({"path": S("The absolute path of the directory"), "ignore": A("Glob patterns to leave out")}, ["path"])),
 ("NotebookRead", "Reads a Jupyter notebook's cells with their outputs.", schema({"notebook_path": S("The absolute path of the notebook")}, ["notebook_path"])),
 ("NotebookEdit", "Replaces, inserts or deletes one cell of a Jupyter notebook.", schema({"notebook_path": S("The absolute path of the notebook"), "cell_number": I("The cell's index"), "new_source": S("The cell's new source"), "edit_mode": S("replace, insert or delete")}, ["notebook_path", "new_source"])),
 ("WebFetch", "Fetches a URL and answers a question about its content.", schema({"url": S("The URL"), "prompt": S("What to find in the page")}, ["url", "prompt"])),
 ("WebSearch", "Searches the web and returns result titles and links.", schema({"query": S("The search query"), "allowed_domains": A("Only these domains")}, ["query"])),
 ("TodoRead", "Reads the session's todo list.", schema({}, [])),
 ("TodoWrite", "Replaces the session's todo list: each item with content, status (pending, in_progress, completed) and priority.", schema({"todos": {"type": "array", "items": schema({"content": S("The task"), "status": S("pending, in_progress or completed"), "priority": S("high, medium or low"), "id": S("A stable id")}, ["content", "status", "priority", "id"])}}, ["todos"])),
 ("Task", "Starts a sub-agent with its own context for a self-contained search or task, and returns its final report.", schema({"description": S("A short description of the task"), "prompt": S("The task in full")}, ["description", "prompt"])),
 ("ExitPlanMode", "Presents the plan to the user and leaves planning mode once they accept it.", schema({"plan": S("The plan, in markdown")}, ["plan"])),
 ("GitStatus", "Shows the working tree's status: staged, unstaged and untracked files.", schema({"path": S("Limit to this path")}, [])),
 ("GitDiff", "Shows the diff of the working tree or between two revisions.", schema({"from": S("The base revision"), "to": S("The other revision"), "path": S("Limit to this path"), "staged": B("The staged changes only")}, [])),
 ("GitLog", "Lists commits with their messages, newest first.", schema({"path": S("Commits touching this path"), "limit": I("How many")}, [])),
 ("GitCommit", "Commits the staged changes with a message.", schema({"message": S("The commit message"), "all": B("Stage every tracked change first")}, ["message"])),
 ("RunTests", "Runs the project's tests, or those matching a filter, and reports the failures with their output.", schema({"filter": S("Only tests whose name contains this"), "package": S("Only this package"), "release": B("Build in release mode")}, [])),
 ("CargoBuild", "Builds the Rust workspace and returns the compiler's errors and warnings.", schema({"package": S("Only this package"), "all_targets": B("Tests and benches too"), "release": B("Build in release mode")}, [])),
 ("CargoClippy", "Runs clippy on the workspace with warnings as errors.", schema({"package": S("Only this package"), "fix": B("Apply the suggested fixes")}, [])),
 ("Format", "Formats the given files, or every file of the project, with the project's formatter.", schema({"paths": A("The files to format")}, [])),
 ("OpenPR", "Opens a pull request from the current branch.", schema({"title": S("The title"), "body": S("The description"), "base": S("The branch to merge into"), "draft": B("Open it as a draft")}, ["title", "body"])),
 ("ListIssues", "Lists the repository's open issues, optionally by label.", schema({"label": S("Only issues with this label"), "limit": I("How many")}, [])),
 ("ReadIssue", "Reads one issue with its comments.", schema({"number": I("The issue number")}, ["number"])),
 ("CommentIssue", "Adds a comment to an issue.", schema({"number": I("The issue number"), "body": S("The comment, in markdown")}, ["number", "body"])),
 ("SearchCode", "Searches the code index for a symbol or phrase across the repository and its dependencies.", schema({"query": S("What to look for"), "language": S("Only this language"), "limit": I("How many results")}, ["query"])),
 ("FindReferences", "Lists every reference to the symbol at a position, from the language server.", schema({"file_path": S("The file"), "line": I("The line, from 1"), "column": I("The column, from 1")}, ["file_path", "line", "column"])),
 ("GoToDefinition", "Finds where the symbol at a position is defined, from the language server.", schema({"file_path": S("The file"), "line": I("The line, from 1"), "column": I("The column, from 1")}, ["file_path", "line", "column"])),
 ("RenameSymbol", "Renames the symbol at a position everywhere it is used, through the language server.", schema({"file_path": S("The file"), "line": I("The line, from 1"), "column": I("The column, from 1"), "new_name": S("The new name")}, ["file_path", "line", "column", "new_name"])),
]
tools = [{"name": n, "description": d, "input_schema": s} for n, d, s in tools]

system = [
 {"type": "text", "text": "You are an interactive command line tool that helps users with software engineering tasks. Use the instructions below and the tools available to you to assist the user."},
 {"type": "text", "text": "\n".join([
  "# Tone and style",
  "You should be concise, direct, and to the point. When you run a non-trivial bash command, explain what the command does and why you are running it. Your output is displayed on a command line interface; use GitHub-flavored markdown for formatting. Only use tools to complete tasks; never use tools or code comments as means to communicate with the user.",
  "# Proactiveness",
  "You are allowed to be proactive, but only when the user asks you to do something. Do what has been asked, nothing more, nothing less. Do not add comments to the code you write unless the user asks you to, or the code is complex and requires additional context.",
  "# Following conventions",
  "When making changes to files, first understand the file's code conventions. Mimic code style, use existing libraries and utilities, and follow existing patterns. Never assume that a given library is available, even if it is well known: check the project's manifest first. When you create a new component, look at existing components to see how they are written; when you edit a piece of code, look at its surrounding context (especially its imports) to understand the choice of frameworks and libraries.",
  "# Doing tasks",
  "The user will primarily request you perform software engineering tasks: solving bugs, adding new functionality, refactoring code, explaining code. For these tasks: use the TodoWrite tool to plan the task if required; use the available search tools to understand the codebase and the user's query; implement the solution using all tools available to you; verify the solution with the project's tests; never assume a specific test framework or script; run the lint and type-check commands when you have completed a task.",
  "# Tool usage policy",
  "When doing file search, prefer to use the Task tool to reduce context usage. You have the capability to call multiple tools in a single response. When multiple independent pieces of information are requested, batch your tool calls together for optimal performance. When making multiple bash tool calls, send a single message with multiple tool calls to run the calls in parallel.",
  "# Code references",
  "When referencing specific functions or pieces of code include the pattern file_path:line_number to allow the user to easily navigate to the source code location.",
  "# Environment",
  "Working directory: /home/dev/sluice\nIs directory a git repo: Yes\nPlatform: linux\nToday's date: 2026-11-27\nModel: agent",
 ]), "cache_control": {"type": "ephemeral"}},
]

files = ["src/proxy/llm_route.rs", "src/router.rs", "plugins/cache/src/policy.rs", "plugins/tenants/src/lib.rs",
         "src/proxy/downstream.rs", "plugins/llm/src/usage.rs", "conf/README.md", "tests/agent_apis.rs"]

def code(path, n):
    lines = []
    for i in range(n):
        w = random.choice(["let", "fn", "match", "if", "return", "//", "pub", "impl"])
        lines.append(f"{i+1:>5}\t    {w} {random.choice(['request', 'pool', 'backend', 'answer', 'ctx', 'usage'])}_{random.randint(1,99)} = {random.choice(['self', 'ctx', 'call'])}.{random.choice(['get', 'find', 'select', 'parse'])}()?;")
    return "\n".join(lines)

tasks = [
 "The cache keeps answers to stored Responses API requests; fix it so that only store:false answers are kept, and add a test.",
]
messages = [{"role": "user", "content": [{"type": "text", "text": tasks[0]}]}]
counter = 0
def tid():
    global counter
    counter += 1
    return f"toolu_{counter:04d}"

plans = [
 [("Grep", {"pattern": "store", "path": "plugins/cache/src", "output_mode": "content", "-n": True}), ("Glob", {"pattern": "plugins/cache/src/**/*.rs"})],
 [("Read", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs"}), ("Read", {"file_path": "/home/dev/sluice/plugins/cache/src/lib.rs", "offset": 280, "limit": 60})],
 [("TodoWrite", {"todos": [{"content": "Find where the cache decides", "status": "completed", "priority": "high", "id": "1"}, {"content": "Ask the family what may be kept", "status": "in_progress", "priority": "high", "id": "2"}, {"content": "Test store:false and store:true", "status": "pending", "priority": "medium", "id": "3"}]})],
 [("GoToDefinition", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "line": 20, "column": 8}), ("FindReferences", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "line": 20, "column": 8}), ("SearchCode", {"query": "fn cache_use", "language": "rust"})],
 [("Read", {"file_path": "/home/dev/sluice/plugins/llm/src/family/mod.rs", "offset": 120, "limit": 80})],
 [("Edit", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "old_string": "    if no_store {\n        return Use::Bypass;\n    }", "new_string": "    if no_store || family_use == CacheUse::Never {\n        return Use::Bypass;\n    }"})],
 [("CargoBuild", {"package": "sluice-plugin-cache"})],
 [("Read", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "offset": 1, "limit": 40}), ("GitDiff", {"path": "plugins/cache"})],
 [("MultiEdit", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "edits": [{"old_string": "use sluice_sdk::{Endpoint, LlmRequest};", "new_string": "use sluice_sdk::family::CacheUse;\nuse sluice_sdk::{Endpoint, LlmCall, LlmRequest};"}, {"old_string": "pub fn decide(config: &CacheConfig, request: &LlmRequest", "new_string": "pub fn decide(config: &CacheConfig, call: &LlmCall"}]})],
 [("CargoBuild", {"package": "sluice-plugin-cache", "all_targets": True}), ("CargoClippy", {"package": "sluice-plugin-cache"})],
 [("Edit", {"file_path": "/home/dev/sluice/plugins/cache/src/lib.rs", "old_string": "policy::decide(&self.config, &call.request,", "new_string": "policy::decide(&self.config, call,"})],
 [("RunTests", {"package": "sluice-plugin-cache", "filter": "policy"})],
 [("Read", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "offset": 60, "limit": 60})],
 [("Edit", {"file_path": "/home/dev/sluice/plugins/cache/src/policy.rs", "old_string": "    #[test]\n    fn cache_control_in_http_terms() {", "new_string": "    #[test]\n    fn each_family_says_what_may_be_kept() {\n        // ...\n    }\n\n    #[test]\n    fn cache_control_in_http_terms() {"})],
 [("RunTests", {"package": "sluice-plugin-cache"}), ("Bash", {"command": "cargo fmt --all -- --check", "description": "Check the formatting"})],
 [("Format", {"paths": ["plugins/cache/src/policy.rs"]}), ("GitStatus", {})],
 [("Bash", {"command": "git diff --stat", "description": "Summarize the change"}), ("TodoWrite", {"todos": [{"content": "Find where the cache decides", "status": "completed", "priority": "high", "id": "1"}, {"content": "Ask the family what may be kept", "status": "completed", "priority": "high", "id": "2"}, {"content": "Test store:false and store:true", "status": "completed", "priority": "medium", "id": "3"}]})],
 [("GitCommit", {"message": "Cache: a stored response is never kept; the family says what may be", "all": True})],
 [("GitLog", {"limit": 3})],
 [],
]
assert len(plans) == 20
texts = ["I'll look for where the cache decides what to keep.", "Let me read the policy and its caller.", "Planning the change.",
         "Finding who calls the decision.", "Reading the family trait.", "Making the change.", "Building.", "Checking the diff so far.",
         "Updating the signature and imports.", "Building with the tests and linting.", "Updating the caller.", "Running the policy tests.",
         "Reading the tests.", "Adding a test for each family.", "Running the whole package's tests and the format check.",
         "Formatting and checking the status.", "Summarizing.", "Committing.", "Checking the log.",
         "Done: the cache now asks each API family whether an answer may be kept; stored responses never are, and store:false answers are kept when deterministic. The new test each_family_says_what_may_be_kept covers it."]
for turn, plan in enumerate(plans):
    content = [{"type": "text", "text": texts[turn]}]
    calls = []
    for name, args in plan:
        i = tid()
        calls.append((i, name, args))
        content.append({"type": "tool_use", "id": i, "name": name, "input": args})
    messages.append({"role": "assistant", "content": content})
    if turn == len(plans) - 1:
        break
    results = []
    for i, name, args in calls:
        if name in ("Read", "Grep", "GitDiff", "SearchCode"):
            out = code(args.get("file_path", "x"), random.randint(12, 24))
        elif name in ("CargoBuild", "CargoClippy", "RunTests"):
            out = "   Compiling sluice-plugin-cache v0.3.0\n    Finished `dev` profile in 4.2s\n" + ("test result: ok. 53 passed; 0 failed" if name == "RunTests" else "")
        else:
            out = "ok"
        results.append({"type": "tool_result", "tool_use_id": i, "content": out})
    if not results:
        results = [{"type": "text", "text": "Go on."}]
    messages.append({"role": "user", "content": results})

session = {"description": "A coding agent's session in Anthropic's Messages shape, written here in the form of a Claude Code session (its system prompt's structure, a 32-tool set, parallel tool calls): 20 requests, request k sending the conversation up to its k-th user message.",
           "system": system, "tools": tools, "messages": messages}
json.dump(session, open(sys.argv[1], "w"), indent=1)
print(len(json.dumps(session)), "bytes;", len(messages), "messages;", sum(1 for m in messages if m["role"] == "user"), "user turns")
