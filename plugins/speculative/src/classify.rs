//! Does a prompt look like code? A cheap guess, to send such prompts to a code-tuned draft pool
//! ("prompts that look like code go to a code-tuned draft"). A wrong guess costs little: the
//! request goes to the other draft, and the confidence check still escalates a poor answer.

/// Points at which a prompt counts as code. One strong sign (2) is not enough on its own, so a
/// prose line that happens to start with `class ` or `import ` stays prose; a second sign of any
/// kind (a `{`/`;` line end, an operator, dense punctuation, another keyword line) tips it.
const CODE_SCORE: u32 = 3;

/// Lines ending in `{`, `}` or `;` count at most this much: prose lists end lines with `;` too.
const MAX_LINE_END_POINTS: u32 = 2;

/// Line starts, case-sensitive, with their points. A keyword that ends in a letter must be
/// followed by a word boundary, so `define` does not match `def`.
const LINE_STARTS: &[(&str, u32)] = &[
    // Rarely the first word of a prose line.
    ("def", 2),
    ("fn", 2),
    ("pub", 2),
    ("impl", 2),
    ("struct", 2),
    ("enum", 2),
    ("mod", 2),
    ("#include", 2),
    ("#define", 2),
    ("#import", 2),
    ("#!/", 2),
    ("#[", 2),
    ("import", 2),
    ("function", 2),
    ("func", 2),
    ("class", 2),
    ("public", 2),
    ("private", 2),
    ("protected", 2),
    ("package", 2),
    ("interface", 2),
    ("namespace", 2),
    ("template<", 2),
    ("async", 2),
    ("export", 2),
    ("console.", 2),
    ("print(", 2),
    ("printf(", 2),
    ("<?php", 2),
    ("SELECT", 2),
    ("INSERT INTO", 3),
    ("DELETE FROM", 3),
    ("CREATE TABLE", 3),
    ("ALTER TABLE", 3),
    // Common in code, but also a plausible first word of a lowercase prose line.
    ("if", 1),
    ("else", 1),
    ("elif", 1),
    ("for", 1),
    ("while", 1),
    ("return", 1),
    ("let", 1),
    ("const", 1),
    ("var", 1),
    ("use", 1),
    ("match", 1),
    ("switch", 1),
    ("case", 1),
    ("try", 1),
    ("catch", 1),
    ("except", 1),
    ("int", 1),
    ("void", 1),
    ("static", 1),
    ("select", 1),
    ("FROM", 1),
    ("WHERE", 1),
    ("JOIN", 1),
    ("GROUP BY", 1),
    ("ORDER BY", 1),
    ("//", 1),
    ("/*", 1),
];

/// Two-character operators that prose does not write (`==` in `=====` does not count).
const OPERATORS: &[[u8; 2]] = &[
    *b"=>", *b"==", *b"!=", *b"->", *b"::", *b"&&", *b"||", *b"+=", *b"-=", *b"<=", *b">=",
];

/// A guess whether `text` is about code. Looks at the text only: code fences, common keywords at
/// line starts (def, fn, class, import, #include, function, public, SELECT...), line ends, code
/// operators and the density of code punctuation ({ } ; ( ) [ ] = < >). Deterministic,
/// allocation-free, O(n).
pub fn looks_like_code(text: &str) -> bool {
    let mut score = 0u32;
    let mut line_end_points = 0u32;
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("```") || code.starts_with("~~~") {
            return true;
        }
        score += line_start_points(code);
        let end = code.trim_end();
        if line_end_points < MAX_LINE_END_POINTS
            && (end.ends_with('{') || end.ends_with('}') || end.ends_with(';'))
        {
            line_end_points += 1;
            score += 1;
        }
        if score >= CODE_SCORE {
            return true;
        }
    }
    score += operator_count(text.as_bytes()).min(CODE_SCORE);
    if has_dense_punctuation(text) {
        score += 2;
    }
    score >= CODE_SCORE
}

/// The points of the keyword `line` (already trimmed at the start) begins with, if any.
fn line_start_points(line: &str) -> u32 {
    if is_sql_query(line) {
        return 3;
    }
    // `from x import y`: Python, not prose.
    if line.starts_with("from ") && line.contains(" import ") {
        return 2;
    }
    LINE_STARTS
        .iter()
        .find(|(keyword, _)| starts_with_word(line, keyword))
        .map_or(0, |(_, points)| *points)
}

/// `line` starts with `keyword`, and a keyword ending in a letter is not the start of a
/// longer word (`define`, `format`, `imports`).
fn starts_with_word(line: &str, keyword: &str) -> bool {
    let Some(rest) = line.strip_prefix(keyword) else {
        return false;
    };
    let ends_in_letter = keyword
        .bytes()
        .last()
        .is_some_and(|b| b.is_ascii_alphabetic());
    !ends_in_letter
        || rest
            .bytes()
            .next()
            .is_none_or(|b| matches!(b, b' ' | b'\t' | b'(' | b'{' | b':' | b'<' | b';' | b'!'))
}

/// A one-line SQL query, `select ... from ...` in either all lower or all upper case (prose
/// writes `Select the answer from ...`).
fn is_sql_query(line: &str) -> bool {
    (line.starts_with("select ") && line.contains(" from "))
        || (line.starts_with("SELECT ") && line.contains(" FROM "))
}

/// Operators from [`OPERATORS`] standing alone: not inside a run like `=====` or `-->`.
fn operator_count(bytes: &[u8]) -> u32 {
    let mut count = 0u32;
    for (i, pair) in bytes.windows(2).enumerate() {
        let (Some(&first), Some(&second)) = (pair.first(), pair.get(1)) else {
            continue;
        };
        if !OPERATORS.contains(&[first, second]) {
            continue;
        }
        let before = i.checked_sub(1).and_then(|j| bytes.get(j));
        let after = bytes.get(i + 2);
        if before != Some(&first) && after != Some(&second) {
            count = count.saturating_add(1);
        }
    }
    count
}

/// Code punctuation is at least a tenth of the visible characters (and at least 4 marks):
/// code runs at 15-35%, prose with a parenthesis or two under 5%. Parentheses count half, as
/// prose uses them too, and a run of one mark counts once (`=====` under a heading).
fn has_dense_punctuation(text: &str) -> bool {
    let (mut half_marks, mut visible) = (0usize, 0usize);
    let mut previous = None;
    for c in text.chars().filter(|c| !c.is_whitespace()) {
        visible += 1;
        if previous != Some(c) {
            half_marks += match c {
                '{' | '}' | '[' | ']' | ';' | '=' | '<' | '>' => 2,
                '(' | ')' => 1,
                _ => 0,
            };
        }
        previous = Some(c);
    }
    half_marks >= 8 && half_marks * 10 >= visible * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    const CODE: &[(&str, &str)] = &[
        (
            "python",
            "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        ),
        (
            "python import",
            "from collections import Counter\n\nwords = Counter(text.split())\nprint(words.most_common(3))",
        ),
        (
            "rust",
            "fn main() {\n    let v = vec![1, 2, 3];\n    println!(\"{:?}\", v);\n}",
        ),
        (
            "rust one-liner",
            "let total: u32 = items.iter().map(|i| i.price).sum();",
        ),
        (
            "javascript",
            "function greet(name) {\n  return `Hello, ${name}!`;\n}",
        ),
        ("javascript arrow", "const add = (a, b) => a + b;"),
        (
            "sql",
            "SELECT name, email\nFROM users\nWHERE active = 1\nORDER BY name;",
        ),
        (
            "sql lowercase one line",
            "select id, total from orders where total > 100",
        ),
        (
            "c",
            "#include <stdio.h>\n\nint main(void) {\n    printf(\"hi\\n\");\n    return 0;\n}",
        ),
        (
            "java",
            "public class Hello {\n    public static void main(String[] args) {}\n}",
        ),
        (
            "fenced block in prose",
            "Can you explain what this does?\n\n```\nx = [i * i for i in range(10)]\n```\n\nThanks!",
        ),
        (
            "fix this bug",
            "fix this bug: the loop never ends\n\nwhile (i < 10) {\n  console.log(i);\n}",
        ),
        (
            "fix this bug inline",
            "fix this bug, it prints nothing: if (x == 1) { print(x); } else { y = x->next; }",
        ),
        (
            "indented python in a question",
            "Why does this raise a KeyError?\n\n    counts = {}\n    for w in words:\n        counts[w] += 1",
        ),
    ];

    const PROSE: &[(&str, &str)] = &[
        (
            "prose",
            "The French Revolution began in 1789 and reshaped Europe. Explain its causes, \
             its main phases, and how it influenced later revolutions in the nineteenth century.",
        ),
        (
            "recipe",
            "Ingredients:\n- 2 cups flour\n- 1 tsp salt (optional)\n- 3 eggs\n\nSteps:\n\
             1. Preheat the oven to 200°C.\n2. Mix everything; knead for 10 minutes.\n\
             3. Bake for 25 minutes, then let it cool.",
        ),
        (
            "question with one parenthesis",
            "What is the capital of France (the country, not the town in Texas)?",
        ),
        (
            "email",
            "Hi Sam,\n\nThanks for sending the report (attached again for reference). Could we \
             move our call to Thursday? Let me know if that works.\n\nBest regards,\nMaria",
        ),
        (
            "a prose line starting with a strong keyword",
            "import duties went up again this year, so prices rose (a lot).",
        ),
        (
            "a prose line starting with a weak keyword",
            "for what it's worth, I liked the talk; the slides were good.",
        ),
        (
            "legal list",
            "The tenant shall:\na) pay the rent on time;\nb) keep the flat clean;\n\
             c) allow inspections with notice;\nd) not sublet (without consent).",
        ),
        (
            "markdown heading and links",
            "Release notes\n=============\n\nSee [the docs](https://example.com/docs) and \
             [the FAQ](https://example.com/faq) for details.",
        ),
        (
            "c++ in prose",
            "I know C++ and Python, which should I learn next?",
        ),
        ("empty", ""),
        (
            "select in prose",
            "Select the best answer from the options below.",
        ),
    ];

    #[test]
    fn code_prompts_look_like_code() {
        for (name, text) in CODE {
            assert!(looks_like_code(text), "{name}: {text}");
        }
    }

    #[test]
    fn prose_prompts_do_not() {
        for (name, text) in PROSE {
            assert!(!looks_like_code(text), "{name}: {text}");
        }
    }

    #[test]
    fn keywords_need_a_word_boundary() {
        assert!(starts_with_word("def f():", "def"));
        assert!(starts_with_word("fn", "fn"));
        assert!(!starts_with_word("define the term", "def"));
        assert!(!starts_with_word("format it", "for"));
        assert!(starts_with_word("#include<x>", "#include"));
    }

    #[test]
    fn operators_inside_runs_do_not_count() {
        assert_eq!(operator_count(b"a == b && c != d"), 3);
        assert_eq!(operator_count(b"=========="), 0);
        assert_eq!(operator_count(b"<!-- comment -->"), 0);
        assert_eq!(operator_count(b""), 0);
    }

    #[test]
    fn deterministic_and_safe_on_any_text() {
        for text in [
            "\u{feff}```",
            "é(",
            "🦀 fn",
            "{",
            "\r\n\r\n",
            "select",
            "sélect x",
        ] {
            assert_eq!(looks_like_code(text), looks_like_code(text));
        }
        assert!(looks_like_code("Here:\r\n  ```rust\r\nlet x = 1;\r\n```"));
    }
}
