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
    let punctuation = Punctuation::of(text);
    score += punctuation.operators.min(CODE_SCORE);
    if punctuation.is_dense() {
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
    // Compared only with the keywords that start with the line's first byte: a prompt can
    // have thousands of lines, and most start with none of them.
    let Some(first) = line.as_bytes().first() else {
        return 0;
    };
    LINE_STARTS
        .iter()
        .filter(|(keyword, _)| keyword.as_bytes().first() == Some(first))
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

/// What a byte is to [`Punctuation`], by table: its loop runs over every byte of prompts that
/// can be megabytes. The low two bits are a mark's weight in half marks.
const HALF_MARK: u8 = 1;
const MARK: u8 = 2;
const SPACE: u8 = 4;
const STARTS_OPERATOR: u8 = 8;
/// A UTF-8 continuation byte: part of a character already counted.
const CONTINUATION: u8 = 16;

const CLASSES: [u8; 256] = {
    let mut classes = [0u8; 256];
    let mut byte = 0x80;
    while byte < 0xC0 {
        classes[byte] = CONTINUATION;
        byte += 1;
    }
    // `char::is_whitespace` of the ASCII characters.
    let spaces = b" \t\n\x0B\x0C\r";
    let mut i = 0;
    while i < spaces.len() {
        classes[spaces[i] as usize] = SPACE;
        i += 1;
    }
    let marks = b"{}[];=<>";
    let mut i = 0;
    while i < marks.len() {
        classes[marks[i] as usize] = MARK;
        i += 1;
    }
    classes[b'(' as usize] = HALF_MARK;
    classes[b')' as usize] = HALF_MARK;
    let mut i = 0;
    while i < OPERATORS.len() {
        classes[OPERATORS[i][0] as usize] |= STARTS_OPERATOR;
        i += 1;
    }
    classes
};

/// The code punctuation of a text, counted in one pass.
struct Punctuation {
    /// Operators from [`OPERATORS`] standing alone: not inside a run like `=====` or `-->`.
    operators: u32,
    /// Marks among the visible characters, in halves: parentheses count half, as prose uses
    /// them too, and a run of one mark counts once (`=====` under a heading).
    half_marks: usize,
    visible: usize,
}

impl Punctuation {
    fn of(text: &str) -> Punctuation {
        let bytes = text.as_bytes();
        let (mut operators, mut half_marks, mut visible) = (0u32, 0usize, 0usize);
        // The last visible character as its byte; 0x80 for one that is not ASCII.
        let mut previous = 0u8;
        for (i, &byte) in bytes.iter().enumerate() {
            let class = CLASSES.get(usize::from(byte)).copied().unwrap_or_default();
            if class & (SPACE | CONTINUATION) != 0 {
                continue;
            }
            if !byte.is_ascii() {
                // A character's first byte: rare enough to decode it, for its whitespace.
                let c = text.get(i..).and_then(|rest| rest.chars().next());
                if !c.is_some_and(char::is_whitespace) {
                    visible += 1;
                    previous = 0x80;
                }
                continue;
            }
            visible += 1;
            if byte != previous {
                half_marks += usize::from(class & (HALF_MARK | MARK));
            }
            previous = byte;
            if class & STARTS_OPERATOR != 0 {
                let next = bytes.get(i + 1).copied();
                let before = i.checked_sub(1).and_then(|j| bytes.get(j)).copied();
                let after = bytes.get(i + 2).copied();
                if next.is_some_and(|next| OPERATORS.contains(&[byte, next]))
                    && before != Some(byte)
                    && after != next
                {
                    operators = operators.saturating_add(1);
                }
            }
        }
        Punctuation {
            operators,
            half_marks,
            visible,
        }
    }

    /// Code punctuation is at least a tenth of the visible characters (and at least 4 marks):
    /// code runs at 15-35%, prose with a parenthesis or two under 5%.
    fn is_dense(&self) -> bool {
        self.half_marks >= 8 && self.half_marks * 10 >= self.visible * 2
    }
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
        let operators = |text: &str| Punctuation::of(text).operators;
        assert_eq!(operators("a == b && c != d"), 3);
        assert_eq!(operators("=========="), 0);
        assert_eq!(operators("<!-- comment -->"), 0);
        assert_eq!(operators(""), 0);
    }

    /// The counts by their definitions, character by character, to check the table's pass.
    fn punctuation_by_definition(text: &str) -> (u32, usize, usize) {
        let bytes = text.as_bytes();
        let mut operators = 0u32;
        for (i, pair) in bytes.windows(2).enumerate() {
            let before = i.checked_sub(1).and_then(|j| bytes.get(j));
            if OPERATORS.contains(&[pair[0], pair[1]])
                && before != Some(&pair[0])
                && bytes.get(i + 2) != Some(&pair[1])
            {
                operators += 1;
            }
        }
        let (mut half_marks, mut visible, mut previous) = (0, 0, None);
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
        (operators, half_marks, visible)
    }

    #[test]
    fn the_one_pass_counts_as_the_definitions_do() {
        let mut texts: Vec<&str> = CODE.iter().chain(PROSE).map(|(_, text)| *text).collect();
        texts.extend([
            "",
            "x\u{a0}=\u{a0}y;\u{3000}é==é",
            "🦀=>🦀 ((a)) [[b]] {{c}} ==== ->->",
            "a\u{85}\u{2028}b\u{b}\u{c}c",
        ]);
        for text in texts {
            let p = Punctuation::of(text);
            assert_eq!(
                (p.operators, p.half_marks, p.visible),
                punctuation_by_definition(text),
                "{text:?}"
            );
        }
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
