"""Build a small multilingual demo corpus in the real shard layout, spoken by espeak-ng.

Usage:
    python scripts/make_demo_corpus.py                         # default sizes, into SHARDS_DIR
    python scripts/make_demo_corpus.py --out demo_data/shards --sizes hi=40,en=20,ta=10 --seed 7
    python scripts/make_demo_corpus.py --engine tones          # synthetic tones, no espeak-ng
    python scripts/make_demo_corpus.py --no-install            # never call the package manager
    python scripts/make_demo_corpus.py --install-espeak        # only install espeak-ng (make test)

Writes, for each language, shards of up to ``--shard-size`` utterances:

    <out>/<source>/<lang>/<shard_name>/{metadata.parquet, audio_index.parquet, audio.tar}

with 16 kHz mono FLAC members, everyday native-script sentences (one to four per utterance), a few
speakers per language (espeak-ng voice variants with their own pitch and speed) and skewed sizes.
A handful of planted defects shows the pipeline handling them; the closing summary and the marker
file ``<out>/.demo_corpus.json`` list each one by segment_id with the stage expected to catch it:

    corrupt_flac           truncated FLAC in the tar        -> dataset reports bad audio
    tag_only_transcript    "[music] [laugh]"                -> build_manifest drops it (empty text)
    script_mislabel_path   Tamil speech in a hi shard       -> make_train_val corrects hi->ta
    script_mislabel_tag    Telugu text, segment_language kn -> make_train_val corrects kn->te
    duplicate_segment_id   a metadata row listed twice      -> make_train_val keeps one
    exact_duplicate        same text and audio, new id      -> make_train_val drops the copy
    too_long / too_short   > MAX_DURATION / < MIN_DURATION  -> build_manifest drops them

espeak-ng: when it is missing, the script tries the system package manager (as root, or through
password-less sudo) unless ``--no-install``; if that fails it prints how to install it and falls
back to synthetic tones (one tone per character) with a warning, so the demo still runs end to end.

Re-running with the same arguments reuses the finished tree (the marker records the parameters);
different arguments rebuild it. The tree is built in a temporary sibling directory and renamed
into place, so an interrupted run never leaves a half-written corpus behind. A directory that is
not a demo corpus (no marker) is never overwritten.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass, replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf
import soxr
from tqdm import tqdm

import config
from manifest_schema import INDEX_FILE, METADATA_FILE, TAR_FILE

# Bump when the generated corpus changes for the same arguments, so old trees are rebuilt.
CORPUS_FORMAT = 1
MARKER_NAME = ".demo_corpus.json"
SAMPLE_RATE = 16000
SOURCES = ("news", "podcast")
DEFAULT_SIZES = {"hi": 300, "en": 150, "ta": 80, "te": 60, "kn": 40, "ml": 40, "bn": 30}
TAG_ONLY_TEXT = "[music] [laugh]"
SHORT_SECONDS = 0.3
# espeak-ng ends every utterance with ~0.3 s of silence; keep this much of it, like a real cut segment.
TRAILING_SILENCE_S = 0.12

# Everyday sentences per language, written in the native script. An utterance joins 1-4 of them.
SENTENCES: dict[str, tuple[str, ...]] = {
    "hi": (
        "नमस्ते, आप कैसे हैं?",
        "मैं ठीक हूँ, धन्यवाद।",
        "आज मौसम बहुत अच्छा है।",
        "मुझे चाय पीना पसंद है।",
        "कृपया दरवाज़ा बंद कर दीजिए।",
        "हम कल बाज़ार जाएँगे।",
        "यह किताब बहुत रोचक है।",
        "बच्चे पार्क में खेल रहे हैं।",
        "आपका नाम क्या है?",
        "मेरा घर स्टेशन के पास है।",
        "बारिश शुरू हो गई है।",
        "खाना तैयार है, आइए बैठिए।",
        "मुझे हिंदी बोलना आता है।",
        "ट्रेन दस बजे आएगी।",
        "पानी का एक गिलास दीजिए।",
        "वह रोज़ सुबह दौड़ने जाता है।",
        "आज दफ़्तर में बहुत काम था।",
        "मेरी माँ बहुत अच्छा खाना बनाती हैं।",
        "क्या आप मेरी मदद कर सकते हैं?",
        "यह सड़क शहर की ओर जाती है।",
        "हमें समय पर पहुँचना चाहिए।",
        "बाहर बहुत ठंड है।",
        "मैंने अभी खाना खाया है।",
        "फ़ोन की बैटरी ख़त्म हो गई।",
        "कल मेरा जन्मदिन है।",
        "डॉक्टर ने आराम करने को कहा है।",
        "यह फल बहुत मीठा है।",
        "मैं अगले हफ़्ते दिल्ली जा रहा हूँ।",
        "किसान खेत में काम कर रहे हैं।",
        "हर दिन कुछ नया सीखना चाहिए।",
    ),
    "en": (
        "Good morning, how are you?",
        "I am fine, thank you.",
        "The weather is very nice today.",
        "I like to drink tea in the evening.",
        "Please close the door.",
        "We will go to the market tomorrow.",
        "This book is very interesting.",
        "The children are playing in the park.",
        "What is your name?",
        "My house is near the station.",
        "It has started to rain.",
        "Dinner is ready, please sit down.",
        "The train will arrive at ten o'clock.",
        "Could I have a glass of water?",
        "She goes for a run every morning.",
        "There was a lot of work at the office today.",
        "My mother cooks very well.",
        "Can you help me with this bag?",
        "This road goes to the city centre.",
        "We should reach on time.",
        "It is very cold outside.",
        "My phone battery is empty.",
        "Tomorrow is my birthday.",
        "The doctor told me to rest for a week.",
        "This fruit is very sweet.",
        "I am going to Delhi next week.",
        "The farmers are working in the field.",
        "We should learn something new every day.",
        "Turn left at the next signal.",
        "The shop opens at nine.",
    ),
    "ta": (
        "வணக்கம், எப்படி இருக்கிறீர்கள்?",
        "நான் நன்றாக இருக்கிறேன், நன்றி.",
        "இன்று வானிலை மிகவும் நன்றாக இருக்கிறது.",
        "எனக்கு காபி குடிக்க பிடிக்கும்.",
        "உங்கள் பெயர் என்ன?",
        "நாளை நாங்கள் சந்தைக்கு போவோம்.",
        "குழந்தைகள் பூங்காவில் விளையாடுகிறார்கள்.",
        "இந்த புத்தகம் மிகவும் சுவாரஸ்யமாக இருக்கிறது.",
        "தயவுசெய்து கதவை மூடுங்கள்.",
        "என் வீடு ரயில் நிலையத்திற்கு அருகில் உள்ளது.",
        "மழை பெய்ய ஆரம்பித்துவிட்டது.",
        "சாப்பாடு தயாராக இருக்கிறது.",
        "எனக்கு தமிழ் பேசத் தெரியும்.",
        "ரயில் பத்து மணிக்கு வரும்.",
        "ஒரு டம்ளர் தண்ணீர் கொடுங்கள்.",
        "அவர் தினமும் காலையில் நடக்கப் போகிறார்.",
        "இன்று அலுவலகத்தில் நிறைய வேலை இருந்தது.",
        "என் அம்மா நன்றாக சமைப்பார்.",
        "நீங்கள் எனக்கு உதவ முடியுமா?",
        "வெளியே மிகவும் குளிராக இருக்கிறது.",
        "நாளை என் பிறந்தநாள்.",
        "இந்த பழம் மிகவும் இனிப்பாக இருக்கிறது.",
        "நான் அடுத்த வாரம் சென்னைக்கு போகிறேன்.",
        "விவசாயிகள் வயலில் வேலை செய்கிறார்கள்.",
    ),
    "te": (
        "నమస్కారం, మీరు ఎలా ఉన్నారు?",
        "నేను బాగున్నాను, ధన్యవాదాలు.",
        "ఈ రోజు వాతావరణం చాలా బాగుంది.",
        "నాకు టీ తాగడం ఇష్టం.",
        "మీ పేరు ఏమిటి?",
        "రేపు మేము బజారుకు వెళ్తాము.",
        "పిల్లలు పార్కులో ఆడుకుంటున్నారు.",
        "ఈ పుస్తకం చాలా ఆసక్తికరంగా ఉంది.",
        "దయచేసి తలుపు మూసేయండి.",
        "మా ఇల్లు రైల్వే స్టేషన్ దగ్గర ఉంది.",
        "వర్షం మొదలైంది.",
        "భోజనం సిద్ధంగా ఉంది.",
        "నాకు తెలుగు మాట్లాడటం వచ్చు.",
        "రైలు పది గంటలకు వస్తుంది.",
        "ఒక గ్లాసు నీళ్ళు ఇవ్వండి.",
        "అతను ప్రతి రోజు ఉదయం నడకకు వెళ్తాడు.",
        "ఈ రోజు ఆఫీసులో చాలా పని ఉంది.",
        "మా అమ్మ చాలా బాగా వంట చేస్తుంది.",
        "మీరు నాకు సహాయం చేయగలరా?",
        "బయట చాలా చలిగా ఉంది.",
        "రేపు నా పుట్టినరోజు.",
        "ఈ పండు చాలా తియ్యగా ఉంది.",
        "నేను వచ్చే వారం హైదరాబాద్ వెళ్తున్నాను.",
        "రైతులు పొలంలో పని చేస్తున్నారు.",
    ),
    "kn": (
        "ನಮಸ್ಕಾರ, ನೀವು ಹೇಗಿದ್ದೀರಿ?",
        "ನಾನು ಚೆನ್ನಾಗಿದ್ದೇನೆ, ಧನ್ಯವಾದಗಳು.",
        "ಇಂದು ಹವಾಮಾನ ತುಂಬಾ ಚೆನ್ನಾಗಿದೆ.",
        "ನನಗೆ ಕಾಫಿ ಕುಡಿಯುವುದು ಇಷ್ಟ.",
        "ನಿಮ್ಮ ಹೆಸರು ಏನು?",
        "ನಾಳೆ ನಾವು ಮಾರುಕಟ್ಟೆಗೆ ಹೋಗುತ್ತೇವೆ.",
        "ಮಕ್ಕಳು ಉದ್ಯಾನದಲ್ಲಿ ಆಡುತ್ತಿದ್ದಾರೆ.",
        "ಈ ಪುಸ್ತಕ ತುಂಬಾ ಆಸಕ್ತಿದಾಯಕವಾಗಿದೆ.",
        "ದಯವಿಟ್ಟು ಬಾಗಿಲು ಮುಚ್ಚಿ.",
        "ನಮ್ಮ ಮನೆ ರೈಲು ನಿಲ್ದಾಣದ ಹತ್ತಿರ ಇದೆ.",
        "ಮಳೆ ಶುರುವಾಗಿದೆ.",
        "ಊಟ ಸಿದ್ಧವಾಗಿದೆ.",
        "ನನಗೆ ಕನ್ನಡ ಮಾತನಾಡಲು ಬರುತ್ತದೆ.",
        "ರೈಲು ಹತ್ತು ಗಂಟೆಗೆ ಬರುತ್ತದೆ.",
        "ಒಂದು ಲೋಟ ನೀರು ಕೊಡಿ.",
        "ಅವನು ಪ್ರತಿದಿನ ಬೆಳಿಗ್ಗೆ ನಡೆಯಲು ಹೋಗುತ್ತಾನೆ.",
        "ಇಂದು ಕಚೇರಿಯಲ್ಲಿ ತುಂಬಾ ಕೆಲಸ ಇತ್ತು.",
        "ನನ್ನ ಅಮ್ಮ ತುಂಬಾ ಚೆನ್ನಾಗಿ ಅಡುಗೆ ಮಾಡುತ್ತಾರೆ.",
        "ನೀವು ನನಗೆ ಸಹಾಯ ಮಾಡಬಹುದೇ?",
        "ಹೊರಗೆ ತುಂಬಾ ಚಳಿ ಇದೆ.",
        "ನಾಳೆ ನನ್ನ ಹುಟ್ಟುಹಬ್ಬ.",
        "ಈ ಹಣ್ಣು ತುಂಬಾ ಸಿಹಿಯಾಗಿದೆ.",
        "ನಾನು ಮುಂದಿನ ವಾರ ಬೆಂಗಳೂರಿಗೆ ಹೋಗುತ್ತಿದ್ದೇನೆ.",
        "ರೈತರು ಹೊಲದಲ್ಲಿ ಕೆಲಸ ಮಾಡುತ್ತಿದ್ದಾರೆ.",
    ),
    "ml": (
        "നമസ്കാരം, സുഖമാണോ?",
        "എനിക്ക് സുഖമാണ്, നന്ദി.",
        "ഇന്ന് കാലാവസ്ഥ വളരെ നല്ലതാണ്.",
        "എനിക്ക് ചായ കുടിക്കാൻ ഇഷ്ടമാണ്.",
        "നിങ്ങളുടെ പേര് എന്താണ്?",
        "നാളെ ഞങ്ങൾ ചന്തയിൽ പോകും.",
        "കുട്ടികൾ പാർക്കിൽ കളിക്കുന്നു.",
        "ഈ പുസ്തകം വളരെ രസകരമാണ്.",
        "ദയവായി വാതിൽ അടയ്ക്കുക.",
        "എന്റെ വീട് റെയിൽവേ സ്റ്റേഷന് അടുത്താണ്.",
        "മഴ തുടങ്ങി.",
        "ഭക്ഷണം തയ്യാറാണ്.",
        "എനിക്ക് മലയാളം സംസാരിക്കാൻ അറിയാം.",
        "ട്രെയിൻ പത്ത് മണിക്ക് വരും.",
        "ഒരു ഗ്ലാസ് വെള്ളം തരൂ.",
        "അവൻ എല്ലാ ദിവസവും രാവിലെ നടക്കാൻ പോകുന്നു.",
        "ഇന്ന് ഓഫീസിൽ ധാരാളം ജോലി ഉണ്ടായിരുന്നു.",
        "എന്റെ അമ്മ നന്നായി പാചകം ചെയ്യും.",
        "നിങ്ങൾക്ക് എന്നെ സഹായിക്കാമോ?",
        "പുറത്ത് നല്ല തണുപ്പാണ്.",
        "നാളെ എന്റെ ജന്മദിനമാണ്.",
        "ഈ പഴം വളരെ മധുരമുള്ളതാണ്.",
        "കർഷകർ വയലിൽ പണിയെടുക്കുന്നു.",
    ),
    "bn": (
        "নমস্কার, আপনি কেমন আছেন?",
        "আমি ভালো আছি, ধন্যবাদ।",
        "আজ আবহাওয়া খুব ভালো।",
        "আমি চা খেতে ভালোবাসি।",
        "আপনার নাম কী?",
        "কাল আমরা বাজারে যাব।",
        "বাচ্চারা মাঠে খেলছে।",
        "এই বইটা খুব মজার।",
        "দয়া করে দরজাটা বন্ধ করুন।",
        "আমার বাড়ি স্টেশনের কাছে।",
        "বৃষ্টি শুরু হয়েছে।",
        "খাবার তৈরি, আসুন বসুন।",
        "আমি বাংলা বলতে পারি।",
        "ট্রেন দশটায় আসবে।",
        "এক গ্লাস জল দিন।",
        "সে রোজ সকালে হাঁটতে যায়।",
        "আজ অফিসে অনেক কাজ ছিল।",
        "আমার মা খুব ভালো রান্না করেন।",
        "আপনি কি আমাকে সাহায্য করতে পারবেন?",
        "বাইরে খুব ঠান্ডা।",
        "কাল আমার জন্মদিন।",
        "এই ফলটা খুব মিষ্টি।",
        "কৃষকরা মাঠে কাজ করছে।",
    ),
    "ur": (
        "السلام علیکم، آپ کیسے ہیں؟",
        "میں ٹھیک ہوں، شکریہ۔",
        "آج موسم بہت اچھا ہے۔",
        "مجھے چائے پینا پسند ہے۔",
        "براہ کرم دروازہ بند کر دیں۔",
        "ہم کل بازار جائیں گے۔",
        "یہ کتاب بہت دلچسپ ہے۔",
        "بچے پارک میں کھیل رہے ہیں۔",
        "آپ کا نام کیا ہے؟",
        "میرا گھر اسٹیشن کے قریب ہے۔",
        "بارش شروع ہو گئی ہے۔",
        "کھانا تیار ہے، آئیے بیٹھیے۔",
        "مجھے اردو بولنا آتا ہے۔",
        "ٹرین دس بجے آئے گی۔",
        "ایک گلاس پانی دیجیے۔",
        "وہ روز صبح دوڑنے جاتا ہے۔",
        "آج دفتر میں بہت کام تھا۔",
        "میری ماں بہت اچھا کھانا پکاتی ہیں۔",
        "کیا آپ میری مدد کر سکتے ہیں؟",
        "باہر بہت سردی ہے۔",
        "کل میری سالگرہ ہے۔",
        "یہ پھل بہت میٹھا ہے۔",
        "میں اگلے ہفتے لاہور جا رہا ہوں۔",
        "کسان کھیت میں کام کر رہے ہیں۔",
    ),
}
# espeak-ng voice per language; English alternates two accents across speakers.
VOICES: dict[str, tuple[str, ...]] = {
    "hi": ("hi",),
    "en": ("en-us", "en-gb"),
    "ta": ("ta",),
    "te": ("te",),
    "kn": ("kn",),
    "ml": ("ml",),
    "bn": ("bn",),
    "ur": ("ur",),
}
VARIANTS = ("m1", "f2", "m3", "f4", "m7", "f1", "m2", "f3", "m4", "f5", "m6", "m5")
INSTALL_HINT = (
    "install espeak-ng with the system package manager, e.g.\n"
    "    sudo apt-get install espeak-ng      # Debian, Ubuntu\n"
    "    sudo dnf install espeak-ng          # Fedora, RHEL\n"
    "    brew install espeak-ng              # macOS\n"
    "then rerun; or pass --engine tones to use synthetic tones on purpose."
)


@dataclass(frozen=True)
class Utterance:
    """One planned tar member (or, for ``duplicate_segment_id``, one extra metadata row)."""

    segment_id: str
    lang: str  # the language directory the row is written under
    source: str
    shard_name: str
    text: str  # transcription_native as written to metadata.parquet
    voice: (
        str  # espeak-ng voice with variant, e.g. "hi+f2" (a path mislabel speaks another language)
    )
    speed: int  # words per minute
    pitch: int  # 0-99
    speaker_id: str
    tx_quality_score: float
    segment_language: str | None
    defect: str = ""
    extra_sentences: tuple[str, ...] = ()  # spoken only for too_long, appended until long enough

    @property
    def shard_id(self) -> str:
        return f"{self.source}/{self.lang}/{self.shard_name}"


def parse_sizes(spec: str) -> dict[str, int]:
    """``"hi=300,en=150"`` -> ``{"hi": 300, "en": 150}``; every language must have sentences."""
    sizes: dict[str, int] = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        lang, sep, count = item.partition("=")
        lang = lang.strip()
        if not sep or not count.strip().isdigit():
            raise ValueError(f"--sizes item {item!r}: expected LANG=COUNT such as 'hi=300'")
        if lang not in SENTENCES:
            raise ValueError(
                f"--sizes item {item!r}: no sentences for {lang!r}; "
                f"available: {', '.join(SENTENCES)}"
            )
        sizes[lang] = int(count)
    if not sizes or sum(sizes.values()) == 0:
        raise ValueError(f"--sizes {spec!r}: expected at least one language with COUNT > 0")
    return sizes


def format_sizes(sizes: dict[str, int]) -> str:
    return ",".join(f"{lang}={n}" for lang, n in sizes.items())


# --- espeak-ng ---------------------------------------------------------------------------------


def _install_command() -> list[list[str]] | None:
    """Commands that install espeak-ng here without a password prompt, or None when none can."""
    if os.name != "posix":
        return None
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif (
        shutil.which("sudo")
        and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
    ):
        prefix = ["sudo", "-n"]
    elif shutil.which("brew"):
        return [["brew", "install", "espeak-ng"]]
    else:
        return None
    if shutil.which("apt-get"):
        # The install alone first: an update is slow and often unneeded.
        return [
            prefix + ["apt-get", "install", "-y", "-q", "espeak-ng"],
            prefix + ["apt-get", "update", "-q"],
            prefix + ["apt-get", "install", "-y", "-q", "espeak-ng"],
        ]
    for manager in ("dnf", "yum", "zypper"):
        if shutil.which(manager):
            return [prefix + [manager, "install", "-y", "espeak-ng"]]
    if shutil.which("apk"):
        return [prefix + ["apk", "add", "espeak-ng"]]
    return None


def ensure_espeak(allow_install: bool) -> str | None:
    """Path of espeak-ng, installing it first when it is missing and ``allow_install``; else None."""
    found = shutil.which("espeak-ng")
    if found or not allow_install:
        return found
    commands = _install_command()
    if commands is None:
        print(
            "espeak-ng is missing and cannot be installed without a password here.", file=sys.stderr
        )
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in commands:
        print(f"espeak-ng is missing; running: {' '.join(cmd)}", file=sys.stderr)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"  failed: {exc}", file=sys.stderr)
            continue
        if done.returncode != 0:
            print(f"  exit {done.returncode}: {done.stderr.strip()[-300:]}", file=sys.stderr)
        if shutil.which("espeak-ng"):
            return shutil.which("espeak-ng")
    return None


def espeak_version() -> str:
    try:
        out = subprocess.run(
            ["espeak-ng", "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except OSError:
        return "espeak-ng"
    return " ".join(out.split()[:4]) or "espeak-ng"


def missing_voices(langs: list[str]) -> list[str]:
    """Voices of ``VOICES[lang]`` that this espeak-ng does not list (older builds lack some Indic ones)."""
    listing = subprocess.run(
        ["espeak-ng", "--voices"], capture_output=True, text=True, timeout=30
    ).stdout
    known = {line.split()[1] for line in listing.splitlines()[1:] if len(line.split()) > 1}
    return [voice for lang in langs for voice in VOICES[lang] if voice not in known]


def _speak_espeak(text: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    # Text goes through stdin, so a sentence starting with "-" is never read as an option.
    done = subprocess.run(
        ["espeak-ng", "-b", "1", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout"],
        input=text.encode("utf-8"),
        capture_output=True,
        timeout=120,
    )
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(
            f"espeak-ng -v {voice} failed on {text!r}: {done.stderr.decode(errors='replace')}"
        )
    signal, rate = sf.read(io.BytesIO(done.stdout), dtype="float32")
    if signal.ndim > 1:
        signal = signal.mean(axis=1)
    return soxr.resample(signal, rate, SAMPLE_RATE).astype(np.float32)


def _speak_tones(text: str, speed: int, pitch: int, seed: int) -> np.ndarray:
    """One short tone per character (a space is a pause), so audio length and content follow the text.

    Frequencies stay below 2 kHz, which is how a test tells tones from speech.
    """
    char_s = 0.07 * 175.0 / speed
    n = int(char_s * SAMPLE_RATE)
    t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
    envelope = np.hanning(n).astype(np.float32)
    shift = 0.75 + pitch / 100.0
    pieces = []
    for ch in text:
        if ch.isspace():
            pieces.append(np.zeros(n // 2, np.float32))
            continue
        f0 = (180.0 + (ord(ch) * 37) % 520) * shift
        pieces.append(
            envelope * (0.5 * np.sin(2 * np.pi * f0 * t) + 0.2 * np.sin(4 * np.pi * f0 * t))
        )
    signal = np.concatenate(pieces or [np.zeros(n, np.float32)])
    noise = np.random.default_rng(seed).standard_normal(signal.size).astype(np.float32)
    return (0.5 * signal + 0.003 * noise).astype(np.float32)


def _trim_trailing_silence(signal: np.ndarray) -> np.ndarray:
    loud = np.nonzero(np.abs(signal) > 0.01 * (np.abs(signal).max() + 1e-9))[0]
    if loud.size == 0:
        return signal
    return signal[: min(signal.size, loud[-1] + 1 + int(TRAILING_SILENCE_S * SAMPLE_RATE))]


def render(job: tuple[Utterance, str, float]) -> tuple[bytes, int, str]:
    """Synthesize one utterance -> (FLAC bytes, samples, transcript actually spoken). Runs in a worker."""
    utt, engine, long_target_s = job
    # Seeded by what is spoken, not by the id, so a re-uploaded copy is byte-identical.
    seed = zlib.crc32(f"{utt.text}|{utt.voice}|{utt.speed}|{utt.pitch}".encode())

    def speak(text: str) -> np.ndarray:
        # Tag-only rows are "music": tones whatever the engine.
        if engine == "tones" or utt.defect == "tag_only_transcript":
            return _speak_tones(text, utt.speed, utt.pitch, seed)
        return _speak_espeak(text, utt.voice, utt.speed, utt.pitch)

    text = utt.text
    signal = _trim_trailing_silence(speak(text))
    if utt.defect == "too_long":
        pieces, words = [signal], [text]
        for sentence in utt.extra_sentences:
            if sum(p.size for p in pieces) / SAMPLE_RATE > long_target_s:
                break
            pieces.append(_trim_trailing_silence(speak(sentence)))
            words.append(sentence)
        signal, text = np.concatenate(pieces), " ".join(words)
    elif utt.defect == "too_short":
        signal = signal[: int(SHORT_SECONDS * SAMPLE_RATE)]
    peak = float(np.abs(signal).max()) or 1.0
    signal = (0.8 / peak) * signal
    buf = io.BytesIO()
    sf.write(buf, signal, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    return buf.getvalue(), int(signal.size), text


# --- planning ----------------------------------------------------------------------------------


def plan_corpus(sizes: dict[str, int], seed: int, shard_size: int) -> list[Utterance]:
    """Every utterance of the corpus, in shard order, with the planted defects. Pure and deterministic."""
    rng = np.random.default_rng(seed)
    plan: list[Utterance] = []
    # Same text, voice and speed give the same duration, and make_train_val would drop the pair as an
    # exact duplicate; the only exact duplicate should be the planted one.
    spoken: set[tuple[str, str, int]] = set()
    for lang, count in sizes.items():
        sentences = SENTENCES[lang]
        n_speakers = int(np.clip(count // 8, 2, 12)) if count > 1 else 1
        speakers = []
        for s in range(n_speakers):
            voice = VOICES[lang][s % len(VOICES[lang])] + "+" + VARIANTS[s % len(VARIANTS)]
            speakers.append(
                (
                    f"{lang}_spk{s + 1:02d}",
                    voice,
                    int(rng.integers(150, 186)),
                    int(rng.integers(35, 66)),
                )
            )
        # Zipf-sized speakers, as in real corpora: a few big ones and a tail of speakers small enough
        # for make_train_val to put whole speakers into a small validation set.
        speaker_share = 1.0 / np.arange(1, n_speakers + 1)
        speaker_share /= speaker_share.sum()
        for i in range(count):
            shard_no = i // shard_size
            k = int(rng.choice([1, 2, 3, 4], p=[0.4, 0.3, 0.2, 0.1]))
            text = " ".join(sentences[j] for j in rng.choice(len(sentences), size=k, replace=False))
            speaker_id, voice, speed, pitch = speakers[int(rng.choice(n_speakers, p=speaker_share))]
            speed = int(np.clip(speed + rng.integers(-12, 13), 120, 220))
            while (text, voice, speed) in spoken:
                speed += 1
            spoken.add((text, voice, speed))
            quality = float(
                np.round(rng.beta(8, 2) if rng.random() > 0.03 else rng.uniform(0.05, 0.3), 3)
            )
            plan.append(
                Utterance(
                    segment_id=f"{SOURCES[shard_no % 2]}_{lang}_{shard_no:04d}_{i:05d}",
                    lang=lang,
                    source=SOURCES[shard_no % 2],
                    shard_name=f"shard_{shard_no:04d}",
                    text=text,
                    voice=voice,
                    speed=speed,
                    pitch=int(np.clip(pitch + rng.integers(-6, 7), 0, 99)),
                    speaker_id=speaker_id,
                    tx_quality_score=quality,
                    segment_language=lang if rng.random() < 0.15 else None,
                )
            )
    return plant_defects(plan, sizes, rng)


def plant_defects(
    plan: list[Utterance], sizes: dict[str, int], rng: np.random.Generator
) -> list[Utterance]:
    """Rewrite a few planned rows into defects (and add two extra rows); skip those whose languages are absent."""
    by_lang: dict[str, list[int]] = {}
    for i, u in enumerate(plan):
        by_lang.setdefault(u.lang, []).append(i)
    big = max(sizes, key=lambda l: sizes[l])
    taken: set[int] = set()

    def pick(lang: str) -> int | None:
        """A random row of ``lang`` that no other defect took yet."""
        free = [i for i in by_lang.get(lang, []) if i not in taken]
        if not free:
            return None
        chosen = free[int(rng.integers(len(free)))]
        taken.add(chosen)
        return chosen

    extra: list[Utterance] = []
    i = pick(big)
    if i is not None:
        plan[i] = replace(plan[i], defect="corrupt_flac")
    i = pick(big)
    if i is not None:
        plan[i] = replace(
            plan[i], defect="tag_only_transcript", text=TAG_ONLY_TEXT, segment_language=None
        )
    other = next((l for l in ("ta", "te", "kn", "ml", "bn") if l in sizes and l != big), None)
    i = pick(big)
    if i is not None and other is not None and big != other:
        u = plan[i]
        plan[i] = replace(
            u,
            defect="script_mislabel_path",
            segment_language=None,
            voice=VOICES[other][0] + "+" + u.voice.split("+")[1],
            text=str(rng.choice(SENTENCES[other])),
        )
    if "te" in sizes and "kn" in sizes:
        i = pick("te")
        if i is not None:
            plan[i] = replace(plan[i], defect="script_mislabel_tag", segment_language="kn")
    i = pick(big)
    if i is not None:
        plan[i] = replace(plan[i], defect="duplicate_segment_id")
        # The second metadata row: same id and text, a worse quality score (no audio of its own).
        extra.append(
            replace(
                plan[i],
                defect="duplicate_segment_id:row",
                tx_quality_score=round(plan[i].tx_quality_score / 2, 3),
            )
        )
    second = sorted(sizes, key=lambda l: -sizes[l])[1] if len(sizes) > 1 else big
    i = pick(second)
    if i is not None:
        u = plan[i]
        last_shard = plan[by_lang[second][-1]].shard_name
        last_source = plan[by_lang[second][-1]].source
        # Re-uploaded under a new id in another shard: identical text, voice and therefore audio.
        extra.append(
            replace(
                u,
                segment_id=f"{last_source}_{second}_reupload_{i:05d}",
                source=last_source,
                shard_name=last_shard,
                defect="exact_duplicate",
            )
        )
        plan[i] = replace(u, defect="exact_duplicate:original")
    i = pick(second)
    if i is not None:
        sentences = SENTENCES[plan[i].lang]
        plan[i] = replace(
            plan[i], defect="too_long", text=sentences[0], extra_sentences=tuple(sentences[1:]) * 3
        )
    i = pick(big)
    if i is not None:
        plan[i] = replace(plan[i], defect="too_short", text=SENTENCES[big][0].split()[0])
    rows = plan + extra
    rows.sort(
        key=lambda u: (
            u.lang != big,
            list(sizes).index(u.lang),
            u.shard_name,
            u.segment_id,
            u.defect,
        )
    )
    return rows


# --- writing -----------------------------------------------------------------------------------


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_shard(
    shard_dir: Path, rows: list[Utterance], audio: dict[str, tuple[bytes, int, str]]
) -> list[dict]:
    """Write metadata.parquet, audio_index.parquet and audio.tar of one shard; return its metadata rows."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    meta, index = [], []
    with tarfile.open(shard_dir / (TAR_FILE + ".tmp"), "w", format=tarfile.USTAR_FORMAT) as tar:
        for u in rows:
            flac, samples, text = audio[u.segment_id]
            meta.append(
                {
                    "segment_id": u.segment_id,
                    "transcription_native": text,
                    "duration_s": samples / SAMPLE_RATE,
                    "tx_quality_score": u.tx_quality_score,
                    "segment_language": u.segment_language,
                    "speaker_id": u.speaker_id,
                    "defect": u.defect,
                }
            )
            if u.defect == "duplicate_segment_id:row":
                continue  # an extra metadata row only; its audio is the first row's member
            member = f"{u.segment_id}.flac"
            if u.defect == "corrupt_flac":
                # A transfer cut short: the header survives, the frames stop a third of the way in.
                flac = flac[: len(flac) // 3]
            info = tarfile.TarInfo(member)
            info.size, info.mode, info.mtime = (
                len(flac),
                0o644,
                0,
            )  # fixed mtime: byte-identical reruns
            tar.addfile(info, io.BytesIO(flac))
            index.append({"segment_id": u.segment_id, "tar_member_name": member})
    os.replace(shard_dir / (TAR_FILE + ".tmp"), shard_dir / TAR_FILE)
    schema = pa.schema(
        [
            ("segment_id", pa.string()),
            ("transcription_native", pa.string()),
            ("duration_s", pa.float64()),
            ("tx_quality_score", pa.float64()),
            ("segment_language", pa.string()),
            ("speaker_id", pa.string()),
        ]
    )
    table = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in meta], schema=schema)
    for name, tbl in (
        (METADATA_FILE, table),
        (
            INDEX_FILE,
            pa.Table.from_pylist(
                index,
                schema=pa.schema([("segment_id", pa.string()), ("tar_member_name", pa.string())]),
            ),
        ),
    ):
        tmp = shard_dir / (name + ".tmp")
        pq.write_table(tbl, tmp)
        os.replace(tmp, shard_dir / name)
    return meta


def read_marker(out: Path) -> dict | None:
    try:
        return json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def build_corpus(
    out: Path,
    sizes: dict[str, int],
    *,
    seed: int = 1234,
    shard_size: int = 50,
    engine: str = "auto",
    allow_install: bool = True,
    jobs: int = 2,
    progress: bool = True,
) -> dict:
    """Build (or reuse) the corpus at ``out`` and return its marker dict (parameters + summary).

    ``engine``: "espeak" (fail when espeak-ng cannot be had), "tones", or "auto" (espeak-ng, else
    tones with a warning). Raises FileExistsError when ``out`` holds something that is not a demo corpus.
    """
    out = Path(out).resolve()
    if engine not in ("auto", "espeak", "tones"):
        raise ValueError(f"engine={engine!r}: expected auto, espeak or tones")
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: expected >= 1")
    used_engine = engine
    if engine != "tones":
        if ensure_espeak(allow_install):
            used_engine = "espeak"
        elif engine == "espeak":
            raise RuntimeError("espeak-ng is not installed (--engine espeak): " + INSTALL_HINT)
        else:
            used_engine = "tones"
            bar = "!" * 78
            print(
                f"\n{bar}\nWARNING: espeak-ng is not available, so the demo corpus is SYNTHETIC TONES, not speech.\n"
                f"The pipeline still runs end to end, but the model learns nothing useful.\nTo get speech, "
                f"{INSTALL_HINT}\n{bar}\n",
                file=sys.stderr,
            )
    if used_engine == "espeak" and (missing := missing_voices(list(sizes))):
        raise RuntimeError(
            f"this espeak-ng has no voice {missing}: leave those languages out of --sizes, "
            "or install a newer espeak-ng (its voice list: espeak-ng --voices)"
        )
    long_target = float(max(config.MAX_DURATION, 20.0)) + 2.0
    params = {
        "format": CORPUS_FORMAT,
        "sizes": sizes,
        "seed": seed,
        "shard_size": shard_size,
        "engine": used_engine,
        "long_target_s": long_target,
    }
    marker = read_marker(out)
    if marker is not None and marker.get("params") == params:
        print(
            f"demo corpus: reusing {out} (built {marker.get('created', '?')} with the same parameters)"
        )
        return marker
    if out.exists() and any(out.iterdir()) and marker is None:
        raise FileExistsError(
            f"{out} exists, is not empty and has no {MARKER_NAME}: it is not a demo corpus, "
            "so it is left alone. Pass another --out or remove it."
        )
    if marker is not None:
        print(f"demo corpus: {out} was built with {marker.get('params')}; rebuilding with {params}")

    started = time.perf_counter()
    plan = plan_corpus(sizes, seed, shard_size)
    tmp_root = out.with_name(out.name + ".building")
    if tmp_root.exists():
        shutil.rmtree(tmp_root)  # a previous run died mid-build
    tmp_root.mkdir(parents=True)
    jobs_list = [
        (u, used_engine, long_target) for u in plan if u.defect != "duplicate_segment_id:row"
    ]
    audio: dict[str, tuple[bytes, int, str]] = {}
    shards: dict[str, list[Utterance]] = {}
    for u in plan:
        shards.setdefault(u.shard_id, []).append(u)
    remaining = {
        sid: sum(1 for u in rows if u.defect != "duplicate_segment_id:row")
        for sid, rows in shards.items()
    }
    metadata: list[dict] = []
    bar = tqdm(
        total=len(jobs_list), desc=f"synthesizing ({used_engine})", unit="utt", disable=not progress
    )
    with Pool(max(1, jobs)) as pool:
        # imap keeps plan order, so each shard is written as soon as its last utterance is back.
        for (u, _, _), result in zip(jobs_list, pool.imap(render, jobs_list, chunksize=4)):
            audio[u.segment_id] = result
            bar.update(1)
            remaining[u.shard_id] -= 1
            if remaining[u.shard_id] == 0:
                rows = shards[u.shard_id]
                metadata += [
                    dict(m, shard_id=u.shard_id, lang=u.lang)
                    for m in write_shard(tmp_root / u.shard_id, rows, audio)
                ]
                for r in rows:
                    audio.pop(r.segment_id, None)
    bar.close()

    summary = summarize(metadata, plan, used_engine, time.perf_counter() - started)
    marker = {
        "params": params,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine_version": espeak_version() if used_engine == "espeak" else "tones",
        "summary": summary,
    }
    _atomic_write_bytes(
        tmp_root / MARKER_NAME, json.dumps(marker, indent=1, ensure_ascii=False).encode()
    )
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp_root, out)
    return marker


def summarize(metadata: list[dict], plan: list[Utterance], engine: str, seconds: float) -> dict:
    per_lang: dict[str, dict] = {}
    for m in metadata:
        s = per_lang.setdefault(
            m["lang"], {"utterances": 0, "seconds": 0.0, "speakers": set(), "shards": set()}
        )
        s["utterances"] += 1
        s["seconds"] += m["duration_s"]
        s["speakers"].add(m["speaker_id"])
        s["shards"].add(m["shard_id"])
    langs = {
        lang: {
            "utterances": s["utterances"],
            "hours": round(s["seconds"] / 3600, 4),
            "speakers": len(s["speakers"]),
            "shards": len(s["shards"]),
        }
        for lang, s in per_lang.items()
    }
    defects = [
        {
            "defect": m["defect"],
            "segment_id": m["segment_id"],
            "shard_id": m["shard_id"],
            "duration_s": round(m["duration_s"], 3),
            "text": m["transcription_native"][:60],
            "segment_language": m["segment_language"],
        }
        for m in metadata
        if m["defect"] and not m["defect"].endswith(":original")
    ]
    return {
        "engine": engine,
        "seconds_to_build": round(seconds, 1),
        "rows": len(metadata),
        "shards": len({m["shard_id"] for m in metadata}),
        "languages": langs,
        "defects": defects,
    }


EXPECTED = {
    "corrupt_flac": "the dataset reports bad audio and skips it",
    "tag_only_transcript": "build_manifest drops it: empty after cleaning",
    "script_mislabel_path": "make_train_val corrects the language from the script",
    "script_mislabel_tag": "make_train_val corrects the language from the script",
    "duplicate_segment_id": "make_train_val keeps one row per segment_id",
    "duplicate_segment_id:row": "(the second row of that segment_id)",
    "exact_duplicate": "make_train_val drops the exact duplicate",
    "too_long": "build_manifest drops it: longer than MAX_DURATION",
    "too_short": "build_manifest drops it: shorter than MIN_DURATION",
}


def print_summary(out: Path, marker: dict) -> None:
    s = marker["summary"]
    print(
        f"\ndemo corpus at {out}  (engine: {marker.get('engine_version', s['engine'])}, "
        f"{s['rows']} metadata rows in {s['shards']} shards, built in {s['seconds_to_build']} s)"
    )
    print(f"  {'lang':<5} {'utterances':>10} {'minutes':>8} {'speakers':>8} {'shards':>6}")
    for lang, v in s["languages"].items():
        print(
            f"  {lang:<5} {v['utterances']:>10} {v['hours'] * 60:>8.1f} {v['speakers']:>8} {v['shards']:>6}"
        )
    print("  planted defects (segment_id: what should happen):")
    for d in s["defects"]:
        print(f"    {d['defect']:<25} {d['segment_id']:<30} {EXPECTED.get(d['defect'], '')}")
    if s["engine"] == "tones":
        print("  WARNING: synthetic tones, not speech (espeak-ng was not available).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog(
            "demo_corpus",
            "Example:\n  python scripts/make_demo_corpus.py --out demo_data/shards "
            "--sizes hi=300,en=150,ta=80,te=60,kn=40,ml=40,bn=30",
        ),
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="shards directory to create (default: SHARDS_DIR)"
    )
    parser.add_argument(
        "--sizes",
        default=format_sizes(DEFAULT_SIZES),
        help=f"utterances per language, LANG=COUNT,... (default {format_sizes(DEFAULT_SIZES)}; "
        f"languages: {', '.join(SENTENCES)})",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of every random choice (default: SEED)"
    )
    parser.add_argument(
        "--shard-size", type=int, default=50, help="utterances per shard (default 50)"
    )
    parser.add_argument(
        "--engine",
        choices=("auto", "espeak", "tones"),
        default="auto",
        help="auto: espeak-ng, else synthetic tones with a warning (default); espeak: fail "
        "without espeak-ng; tones: synthetic tones on purpose",
    )
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="never try to install a missing espeak-ng with the package manager",
    )
    parser.add_argument(
        "--install-espeak",
        action="store_true",
        help="only make sure espeak-ng is installed (package manager when missing), build "
        "nothing; exit 0 when it is available afterwards, else 1 with how to install it",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="synthesis processes (default: min(2, CPUs))",
    )
    args = parser.parse_args(argv)
    if args.install_espeak:
        found = ensure_espeak(allow_install=not args.no_install)
        print(f"espeak-ng: {found}" if found else "espeak-ng is not available: " + INSTALL_HINT)
        return 0 if found else 1
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.out if args.out is not None else config.SHARDS_DIR)
    try:
        marker = build_corpus(
            out,
            sizes,
            seed=config.SEED if args.seed is None else args.seed,
            shard_size=args.shard_size,
            engine=args.engine,
            allow_install=not args.no_install,
            jobs=args.jobs,
        )
    except (FileExistsError, RuntimeError, ValueError) as exc:
        print(f"make_demo_corpus: error: {exc}", file=sys.stderr)
        return 1
    print_summary(out.resolve(), marker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
