"""Build ``vllm_specx/prompts/eagle3_train.jsonl``: ~2,000 training prompts for
``vllm-specx distill-eagle3`` (and ``distill``), from text that ships with this machine's
Python and installed packages plus templates written for this project, each line carrying
its source and licence; and ``vllm_specx/prompts/eagle3_heldout.jsonl``: the held-out
prompts the shipped head's REPORT was measured on (pass it as ``--heldout-prompts``).

    source scripts/env.sh && python scripts/build_eagle3_prompts.py [--check]

Deterministic for one Python (3.11.7) and the installed package versions (recorded in the
docs' provenance table). ``--check`` rebuilds in memory and fails when the committed file
differs. No network, no model: the target answers these prompts later, in the data stage.

Families (``source`` prefix; counts and licences in docs/training/distill-eagle3.md):

* ``real_distill``: the 144 training prompts of ``real_distill.jsonl`` (seed-0 split: its
  16 held-out prompts are the ones the shipped head's REPORT measured, kept out);
* ``stdlib``: docstrings and signatures of the Python standard library (PSF-2.0): code
  prefixes (signature + docstring, the target writes the body) and chat instructions
  ("write", "explain", "summarise");
* ``pydoc_topics``: the language-reference topics of ``pydoc_data`` (PSF-2.0);
* ``pypi:<package>``: docstrings of installed permissively licensed packages;
* ``templates:<lang>``: self-instruct style templates written for this project in nine
  natural languages, filled with CLDR's localized country, language and month names as
  Babel ships them (Unicode-3.0);
* ``templates:code`` / ``templates:chat``: tasks in eight programming languages and
  everyday English instructions, written for this project.

Held out, never in the output (``tests/training/test_eagle3_prompts.py`` checks it): the
fixture build's held-out stdlib files (its own hash rule, so every one of them, not only the
64 snippets stored in fixtures/models/heldout_prompts.jsonl), the benchmark's
``real_heldout.jsonl``, and the 16 held-out prompts of ``real_distill.jsonl``; a candidate
sharing any 40-character stretch (normalised) with one of them is dropped too.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_DIR = ROOT / "vllm_specx" / "prompts"
OUT = PROMPTS_DIR / "eagle3_train.jsonl"
HELDOUT_OUT = PROMPTS_DIR / "eagle3_heldout.jsonl"
SEED = 33
# SmolLM2-Instruct's chat turn exactly as real_distill.jsonl writes it (the target's own
# template with its default system prompt), so instruction rows look like served requests.
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
# The project declares no licence of its own yet: its own text is marked as such.
PROJECT_LICENCE = "vllm-specx's own text (the project's licence)"
# Fixture build's split (scripts/build_fixture_models.py: BuildConfig.seed, heldout_every,
# path_hash): a stdlib file is held out when this hash % 20 == 0.
FIXTURE_SEED, FIXTURE_HELDOUT_EVERY = 1234, 20
OVERLAP_CHARS = 40
# Installed packages whose docstrings are used, with the licence their metadata declares
# (License-Expression or trove classifier, read when this list was made).
PACKAGES = {
    "jinja2": "BSD-3-Clause", "markdown": "BSD-3-Clause", "pygments": "BSD-2-Clause",
    "rich": "MIT", "click": "BSD-3-Clause", "requests": "Apache-2.0", "yaml": "MIT",
    "numpy": "BSD-3-Clause", "sympy": "BSD-3-Clause", "networkx": "BSD-3-Clause",
    "httpx": "BSD-3-Clause", "attr": "MIT",
}
SKIP_STDLIB_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo",
                     "ensurepip", "__pycache__", "tkinter", "pydoc_data", "encodings"}


def fixture_heldout_file(rel: str) -> bool:
    h = int(hashlib.sha256(f"{FIXTURE_SEED}:{rel}".encode()).hexdigest()[:12], 16)
    return h % FIXTURE_HELDOUT_EVERY == 0


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def user_text(prompt: str) -> str:
    """The part of a prompt that differs between prompts (the user turn of a chat prompt)."""
    m = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)
    return m.group(1) if m else prompt


def heldout_texts() -> list[str]:
    """Every held-out text the training prompts must stay clear of."""
    sys.path.insert(0, str(ROOT))
    from vllm_specx.fixtures import materialise_heldout

    texts = []
    fixture = ROOT / "fixtures" / "models" / "heldout_prompts.jsonl"
    for line in fixture.read_text(encoding="utf-8").splitlines():
        record = materialise_heldout(json.loads(line)) if line.strip() else None
        if record is not None:  # None: not in this Python's stdlib (warned)
            texts.append(record["text"])
    for line in (PROMPTS_DIR / "real_heldout.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.append(user_text(json.loads(line)["prompt"]))
    texts += [user_text(p["prompt"]) for p in real_distill_split()[1]]
    return texts


def real_distill_split() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) rows of real_distill.jsonl as the shipped head's build split them
    (split_prompts(160, 0.1, seed 0): its REPORT's held-out prompts)."""
    from vllm_specx.training.distill import split_prompts

    rows = [json.loads(x) for x in
            (PROMPTS_DIR / "real_distill.jsonl").read_text(encoding="utf-8").splitlines()
            if x.strip()]
    train, held = split_prompts(len(rows), 0.1, 0)
    return [rows[i] for i in train], [rows[i] for i in held]


class Collector:
    """Distinct prompts, each checked against the held-out texts as it is added."""

    def __init__(self, held: list[str]) -> None:
        self.rows: list[dict[str, str]] = []
        self.seen: set[str] = set()
        self.windows: set[str] = set()
        self.held_norm = [normalise(t) for t in held]
        for t in self.held_norm:
            for i in range(max(1, len(t) - OVERLAP_CHARS + 1)):
                self.windows.add(t[i:i + OVERLAP_CHARS])
        self.rejected = 0

    def overlaps(self, text: str) -> bool:
        t = normalise(text)
        if any(t in h or (len(h) >= 12 and h in t) for h in self.held_norm):
            return True
        return any(t[i:i + OVERLAP_CHARS] in self.windows
                   for i in range(0, max(1, len(t) - OVERLAP_CHARS + 1)))

    def add(self, kind: str, lang: str, prompt: str, source: str, licence: str) -> bool:
        if prompt in self.seen:
            return False
        if self.overlaps(user_text(prompt)):
            self.rejected += 1
            return False
        self.seen.add(prompt)
        self.rows.append({"kind": kind, "lang": lang, "source": source, "license": licence,
                          "prompt": prompt})
        return True


# --------------------------------------------------------------------------------------------
# Docstrings (stdlib and installed packages), read with ast: nothing is imported or run.
# --------------------------------------------------------------------------------------------


def first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    para = re.sub(r"\s+", " ", para)
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).strip()


def docstring_items(root: Path, rel_files: list[str], module_of: str) -> list[dict[str, str]]:
    """Public documented functions of the files: module, name, args, docstring."""
    items = []
    for rel in rel_files:
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = module_of + rel[:-3].replace("/", ".").removesuffix(".__init__")
        for node in tree.body:
            nodes = [(node, "")]
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                nodes += [(n, node.name + ".") for n in node.body]
            for fn, prefix in nodes:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if fn.name.startswith("_"):
                    continue
                doc = ast.get_docstring(fn)
                if not doc or not 20 <= len(first_sentence(doc)) <= 200:
                    continue
                if any(c in doc for c in ("\x00", "<|")):
                    continue
                try:
                    args = ast.unparse(fn.args)
                except Exception:  # noqa: BLE001 (an odd signature is just skipped)
                    continue
                items.append({"module": module, "name": prefix + fn.name, "args": args,
                              "doc": doc.strip(), "file": rel,
                              "async": isinstance(fn, ast.AsyncFunctionDef)})
    return items


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if SKIP_STDLIB_PARTS.intersection(parts) or parts[-1].startswith("_") and \
                parts[-1] != "__init__.py" or parts[0].startswith("_"):
            continue
        if fixture_heldout_file(rel):
            continue  # the fixture pair's held-out files: none of their text is used
        out.append(rel)
    return out


def code_prefix(item: dict[str, str]) -> str:
    """Signature and docstring as a Python prefix: the target writes the body."""
    name = item["name"].split(".")[-1]
    doc = item["doc"]
    if len(doc) > 600:
        doc = doc[:600].rsplit("\n", 1)[0]
    doc = "\n".join(("    " + line) if line.strip() else ""
                    for line in doc.replace('"""', "'''").splitlines()).lstrip()
    kw = "async def" if item["async"] else "def"
    return f'{kw} {name}({item["args"]}):\n    """{doc}\n    """\n'


def doc_prompts(c: Collector, items: list[dict[str, str]], source: str, licence: str,
                rng: random.Random, counts: dict[str, int]) -> None:
    rng.shuffle(items)
    pos = 0
    for kind, n in counts.items():
        made = 0
        while made < n and pos < len(items):
            it = items[pos]
            pos += 1
            where = f"{source}:{it['file']}:{it['name']}"
            summary = first_sentence(it["doc"]).rstrip(".")
            name = it["name"].split(".")[-1]
            if kind == "code":
                ok = c.add("code", "python", code_prefix(it), where, licence)
            elif kind == "write":
                ok = c.add("instruction", "en", CHAT.format(
                    f"Write a Python function `{name}({it['args']})`. Its documentation "
                    f"says: \"{summary}.\""), where, licence)
            elif kind == "explain":
                ok = c.add("instruction", "en", CHAT.format(
                    f"Explain what `{it['module']}.{it['name']}` does in Python and show a "
                    "short example of using it."), where, licence)
            else:  # summarise
                para = it["doc"].split("\n\n")[0].strip()
                if len(para) < 120:
                    continue
                ok = c.add("instruction", "en", CHAT.format(
                    "Summarise this documentation in one or two plain sentences:\n\n"
                    + para[:900]), where, licence)
            made += ok


def pydoc_topic_prompts(c: Collector) -> None:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key].strip()
        title = text.splitlines()[0].strip()
        c.add("instruction", "en", CHAT.format(
            f"Explain the Python language topic \"{title}\" ({key}) to a beginner, with an "
            "example."), f"pydoc_topics:{key}", "PSF-2.0")
        body = re.sub(r"\s+", " ", text)
        if len(body) > 400:
            cut = body[:360].rsplit(" ", 1)[0]
            c.add("prose", "en", cut + " ", f"pydoc_topics:{key}", "PSF-2.0")


# --------------------------------------------------------------------------------------------
# Templates written for this project.
# --------------------------------------------------------------------------------------------

# Per language: instruction templates ({country}, {language}, {month}) and prose openings.
LANG_TEMPLATES: dict[str, tuple[list[str], list[str]]] = {
    "fr": (["Écris un court paragraphe sur {country}.",
            "Quelles sont trois choses à savoir avant de voyager en {country} ?",
            "Explique en quelques phrases où l'on parle le {language} et pourquoi.",
            "Écris un petit poème sur le mois de {month}.",
            "Donne trois conseils pour apprendre le {language}."],
           ["Il était une fois, en {country}, un vieux pêcheur qui",
            "Au mois de {month}, le village se réveillait toujours"]),
    "es": (["Escribe un párrafo breve sobre {country}.",
            "¿Qué tres cosas debería saber alguien antes de viajar a {country}?",
            "Explica en pocas frases dónde se habla {language}.",
            "Escribe un poema corto sobre el mes de {month}.",
            "Dame tres consejos para aprender {language}."],
           ["Había una vez, en {country}, una niña que",
            "En {month}, las calles de la ciudad"]),
    "de": (["Schreibe einen kurzen Absatz über {country}.",
            "Was sollte man vor einer Reise nach {country} wissen? Nenne drei Dinge.",
            "Erkläre in wenigen Sätzen, wo {language} gesprochen wird.",
            "Schreibe ein kurzes Gedicht über den Monat {month}.",
            "Gib mir drei Tipps, um {language} zu lernen."],
           ["Es war einmal in {country} ein alter Uhrmacher, der",
            "Im {month} lag über dem Dorf immer"]),
    "it": (["Scrivi un breve paragrafo su {country}.",
            "Quali sono tre cose da sapere prima di viaggiare in {country}?",
            "Spiega in poche frasi dove si parla {language}.",
            "Scrivi una breve poesia sul mese di {month}.",
            "Dammi tre consigli per imparare {language}."],
           ["C'era una volta, in {country}, un giovane fornaio che",
            "A {month} la piazza del paese"]),
    "pt": (["Escreva um parágrafo curto sobre {country}.",
            "Quais são três coisas que se deve saber antes de viajar para {country}?",
            "Explique em poucas frases onde se fala {language}.",
            "Escreva um poema curto sobre o mês de {month}.",
            "Dê três dicas para aprender {language}."],
           ["Era uma vez, em {country}, um menino que",
            "Em {month}, o mercado da cidade"]),
    "nl": (["Schrijf een korte alinea over {country}.",
            "Wat moet je weten voordat je naar {country} reist? Noem drie dingen.",
            "Leg in een paar zinnen uit waar {language} gesproken wordt.",
            "Schrijf een kort gedicht over de maand {month}.",
            "Geef drie tips om {language} te leren."],
           ["Er was eens, in {country}, een oude molenaar die",
            "In {month} was het stadje altijd"]),
    "ru": (["Напиши короткий абзац о стране {country}.",
            "Какие три вещи нужно знать перед поездкой в страну {country}?",
            "Объясни в нескольких предложениях, где говорят на языке {language}.",
            "Напиши короткое стихотворение о месяце {month}.",
            "Дай три совета, как выучить язык {language}."],
           ["Жил-был в стране {country} старый учитель, который",
            "В месяце {month} наш город всегда"]),
    "zh": (["请写一段关于{country}的简短介绍。",
            "去{country}旅行之前应该知道哪三件事？",
            "用几句话解释{language}主要在哪些地方使用。",
            "写一首关于{month}的短诗。",
            "给我三个学习{language}的建议。"],
           ["很久以前，在{country}，有一位老渔夫，他",
            "每到{month}，小镇上总是"]),
    "ja": (["{country}について短い段落を書いてください。",
            "{country}に旅行する前に知っておくべきことを三つ教えてください。",
            "{language}がどこで話されているか、数文で説明してください。",
            "{month}についての短い詩を書いてください。",
            "{language}を学ぶための三つのコツを教えてください。"],
           ["昔々、{country}に一人の年老いた漁師がいて、",
            "{month}になると、町はいつも"]),
}
# Territories and languages whose CLDR names fill the templates (common ones, so the target
# has something to say).
TERRITORIES = ["FR", "ES", "DE", "IT", "PT", "NL", "RU", "CN", "JP", "BR", "MX", "AR", "CA",
               "IN", "EG", "KE", "NG", "ZA", "AU", "NZ", "SE", "NO", "FI", "PL", "GR", "TR",
               "MA", "PE", "CL", "CO", "VN", "TH", "KR", "ID", "IE", "CH", "AT", "BE", "IS",
               "DK"]
LANGUAGES = ["en", "fr", "es", "de", "it", "pt", "nl", "ru", "zh", "ja", "ar", "hi", "sw",
             "ko", "pl", "tr", "el", "sv", "fi", "vi"]

CODE_TASKS = [
    "reverses a string", "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number", "counts the words in a text",
    "removes duplicates from an array while keeping the order",
    "finds the largest element of an array", "computes the factorial of a number",
    "merges two sorted arrays", "checks whether a year is a leap year",
    "converts Celsius to Fahrenheit", "sums the digits of an integer",
    "returns the greatest common divisor of two integers", "splits a list into chunks of size n",
    "capitalises the first letter of every word", "counts the vowels in a string",
    "computes the average of an array of numbers", "checks whether a number is even",
    "returns the intersection of two arrays", "rotates an array by k positions",
    "parses a date in YYYY-MM-DD format", "validates a simple email address",
    "implements binary search on a sorted array", "sorts an array with insertion sort",
    "computes the dot product of two vectors", "transposes a matrix",
    "counts the occurrences of each character in a string", "converts a number to binary",
    "checks whether two strings are anagrams", "returns the median of an array",
    "flattens a nested array one level deep", "reads a text file line by line",
    "implements a simple stack with push and pop", "implements a queue with two stacks",
    "computes the Levenshtein distance between two strings",
    "generates all permutations of a short string", "returns the prime factors of an integer",
    "checks whether parentheses in a string are balanced",
    "converts a Roman numeral to an integer", "formats a number with thousands separators",
    "computes the running sum of an array",
]
CODE_LANGS = {
    "javascript": ("JavaScript", "// A JavaScript function that {task}.\nfunction "),
    "typescript": ("TypeScript", "// A TypeScript function that {task}.\nexport function "),
    "c": ("C", "/* A C function that {task}. */\n#include <stdio.h>\n\n"),
    "cpp": ("C++", "// A C++ function that {task}.\n#include <vector>\n\n"),
    "rust": ("Rust", "/// A Rust function that {task}.\nfn "),
    "go": ("Go", "// A Go function that {task}.\nfunc "),
    "java": ("Java", "// A Java method that {task}.\npublic static "),
    "bash": ("Bash", "#!/usr/bin/env bash\n# A Bash script that {task}.\n"),
}
CHAT_TOPICS = [
    "saving money on groceries", "learning to play the guitar", "starting a vegetable garden",
    "preparing for a job interview", "training for a first 5 km run", "keeping houseplants alive",
    "reducing screen time", "learning a new language as an adult", "planning a road trip",
    "writing a cover letter", "cooking rice without a rice cooker",
    "staying focused while studying",
    "organising a small kitchen", "making friends in a new city", "choosing a first laptop",
    "giving a short presentation", "caring for a new puppy", "reading more books",
    "drinking more water", "keeping a journal", "baking bread at home", "composting",
    "the water cycle", "how vaccines work", "why the sky is blue", "how volcanoes form",
    "the causes of the seasons", "how a bicycle stays upright", "black holes", "the printing press",
    "the Roman Empire", "the invention of the telephone", "how bees make honey",
    "the life cycle of a butterfly", "renewable energy", "how the stock market works",
    "compound interest", "the difference between weather and climate", "how rainbows form",
    "the human heart", "how airplanes fly", "plate tectonics", "the moon's phases",
    "recycling plastic", "how the internet works", "public key cryptography",
    "the French Revolution", "the Silk Road", "coral reefs", "how memory works in the brain",
    "version control with git", "unit testing", "recursion", "hash tables", "REST APIs",
    "SQL joins", "time complexity", "regular expressions", "virtual environments in Python",
    "the difference between a process and a thread",
]
CHAT_TEMPLATES = [
    "Explain {topic} to a ten-year-old.", "Give me five practical tips about {topic}.",
    "Write a short blog post introduction about {topic}.",
    "What are the most common mistakes people make with {topic}?",
    "Summarise the key ideas of {topic} in three bullet points.",
    "Write a haiku about {topic}.", "Create a short quiz with three questions about {topic}.",
    "Write a friendly email to a colleague recommending a resource on {topic}.",
    "Describe {topic} in one paragraph for a school textbook.",
    "List the pros and cons of {topic}.",
]


def template_prompts(c: Collector, rng: random.Random, per_lang: int, code_n: int,
                     chat_n: int) -> None:
    from babel import Locale

    for lang, (instr, prose) in LANG_TEMPLATES.items():
        loc = Locale(lang)
        months = [loc.months["format"]["wide"][m] for m in range(1, 13)]
        combos = []
        for t in instr + prose:
            for ter in TERRITORIES:
                for lng in LANGUAGES:
                    combos.append((t, ter, lng))
        rng.shuffle(combos)
        made = 0
        for t, ter, lng in combos:
            if made >= per_lang:
                break
            text = t.format(country=loc.territories[ter], language=loc.languages[lng],
                            month=months[(TERRITORIES.index(ter) + LANGUAGES.index(lng)) % 12])
            if t in prose:
                made += c.add("prose", lang, text, f"templates:{lang}+cldr",
                              f"{PROJECT_LICENCE}; CLDR names: Unicode-3.0 via Babel "
                              "(BSD-3-Clause)")
            else:
                made += c.add("instruction", lang, CHAT.format(text), f"templates:{lang}+cldr",
                              f"{PROJECT_LICENCE}; CLDR names: Unicode-3.0 via Babel "
                              "(BSD-3-Clause)")
    pairs = [(task, lang, style) for task in CODE_TASKS for lang in CODE_LANGS
             for style in ("prefix", "chat")]
    rng.shuffle(pairs)
    for task, lang, style in pairs[:code_n]:
        name, prefix = CODE_LANGS[lang]
        if style == "prefix":
            c.add("code", lang, prefix.format(task=task), "templates:code", PROJECT_LICENCE)
        else:
            c.add("instruction", "en", CHAT.format(f"Write a {name} function that {task}."),
                  "templates:code", PROJECT_LICENCE)
    chats = [(t, topic) for t in CHAT_TEMPLATES for topic in CHAT_TOPICS]
    rng.shuffle(chats)
    made = 0
    for t, topic in chats:
        if made >= chat_n:
            break
        made += c.add("instruction", "en", CHAT.format(t.format(topic=topic)),
                      "templates:chat", PROJECT_LICENCE)


def build() -> tuple[list[dict[str, str]], list[dict[str, str]], dict[str, Any]]:
    held = heldout_texts()
    c = Collector(held)
    rng = random.Random(SEED)
    train, held_rows = real_distill_split()
    for row in train:
        c.add(row["kind"], "en" if row["kind"] != "code" else "python", row["prompt"],
              "real_distill", PROJECT_LICENCE)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = docstring_items(stdlib, stdlib_files(), "")
    doc_prompts(c, items, "stdlib", "PSF-2.0", rng,
                {"code": 360, "write": 260, "explain": 220, "summarise": 140})
    pydoc_topic_prompts(c)
    purelib = Path(sysconfig.get_paths()["purelib"])
    for pkg, licence in PACKAGES.items():
        root = purelib / pkg
        files = sorted(p.relative_to(purelib).as_posix() for p in root.rglob("*.py")
                       if not {"tests", "test", "testing", "_vendor"} & set(p.parts))
        pitems = docstring_items(purelib, files, "")
        doc_prompts(c, pitems, f"pypi:{pkg}", licence, rng,
                    {"code": 8, "explain": 8, "summarise": 6})
    template_prompts(c, rng, per_lang=40, code_n=240, chat_n=260)
    stats: dict[str, Any] = {"rows": len(c.rows), "rejected_overlap": c.rejected}
    return c.rows, held_rows, stats


def dump(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="fail when the committed files differ from a rebuild")
    args = ap.parse_args()
    rows, held_rows, stats = build()
    text = dump(rows)
    held_text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in held_rows)
    if args.check:
        same = OUT.read_text(encoding="utf-8") == text and \
            HELDOUT_OUT.read_text(encoding="utf-8") == held_text
        print("up to date" if same else "differs from a rebuild")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    HELDOUT_OUT.write_text(held_text, encoding="utf-8")
    by_family: dict[str, int] = {}
    for r in rows:
        fam = r["source"].split(":")[0] + (":" + r["source"].split(":")[1]
                                           if r["source"].startswith(("pypi", "templates"))
                                           else "")
        by_family[fam] = by_family.get(fam, 0) + 1
    print(json.dumps({**stats, "bytes": len(text.encode()), "by_family": by_family,
                      "by_kind": {k: sum(r["kind"] == k for r in rows)
                                  for k in ("instruction", "code", "prose")},
                      "by_lang": {lang: sum(r["lang"] == lang for r in rows)
                                  for lang in sorted({r["lang"] for r in rows})}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
