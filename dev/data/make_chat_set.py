"""
Writes the small chat set that ships with the repo for `make finetune`: short question/answer conversations made
from templates (arithmetic, counting, unit conversions, words, days and months, comparisons, sorting), some with a
system message, some with a follow-up turn. Every answer is computed, so it is correct, and answers share one
plain style ("12 plus 30 is 42."), which a fine-tune picks up quickly: the val loss shows it.

Seeded: the same command writes the same files (dev/test/test_chat.py checks that the committed files are this
script's output).

    python dev/data/make_chat_set.py --out_dir dev/data/chat     # chat_train.jsonl, chat_val.jsonl
"""

import argparse
import json
import os
import random

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WORDS = ["river", "mountain", "garden", "window", "pencil", "orange", "planet", "bridge", "candle", "forest",
         "rocket", "silver", "kitten", "marble", "thunder", "lantern", "harbor", "meadow", "puzzle", "castle",
         "violin", "island", "button", "pepper", "shadow", "falcon", "anchor", "cotton", "dragon", "ladder"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence.",
           "You answer questions briefly and exactly."]
NUMBER_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def add(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    q = rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}.", f"What do you get when you add {a} to {b}?",
                    f"Compute {a} + {b}."])
    return q, f"{a} plus {b} is {a + b}."


def subtract(rng):
    a = rng.randint(20, 150)
    b = rng.randint(1, a)
    q = rng.choice([f"What is {a} minus {b}?", f"Subtract {b} from {a}.", f"Compute {a} - {b}."])
    return q, f"{a} minus {b} is {a - b}."


def multiply(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    q = rng.choice([f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"Compute {a} x {b}."])
    return q, f"{a} times {b} is {a * b}."


def letters(rng):
    w = rng.choice(WORDS)
    q = rng.choice([f"How many letters are in the word '{w}'?", f"Count the letters in '{w}'."])
    return q, f"The word '{w}' has {len(w)} letters."


def backwards(rng):
    w = rng.choice(WORDS)
    q = rng.choice([f"Spell '{w}' backwards.", f"Write the word '{w}' in reverse."])
    return q, f"'{w}' backwards is '{w[::-1]}'."


def uppercase(rng):
    w = rng.choice(WORDS)
    q = rng.choice([f"Write '{w}' in capital letters.", f"Give the uppercase form of '{w}'."])
    return q, f"In capital letters, '{w}' is '{w.upper()}'."


def first_letter(rng):
    w = rng.choice(WORDS)
    q = rng.choice([f"What is the first letter of '{w}'?", f"Which letter does '{w}' start with?"])
    return q, f"'{w}' starts with the letter '{w[0]}'."


def minutes(rng):
    h = rng.randint(1, 12)
    q = rng.choice([f"How many minutes are in {h} hours?", f"Convert {h} hours to minutes."])
    return q, f"{h} hours is {60 * h} minutes."


def meters(rng):
    k = rng.randint(1, 40)
    q = rng.choice([f"How many meters are in {k} kilometers?", f"Convert {k} kilometers to meters."])
    return q, f"{k} kilometers is {1000 * k} meters."


def grams(rng):
    k = rng.randint(1, 25)
    q = rng.choice([f"How many grams are in {k} kilograms?", f"Convert {k} kilograms to grams."])
    return q, f"{k} kilograms is {1000 * k} grams."


def next_day(rng):
    i = rng.randrange(7)
    q = rng.choice([f"What day comes after {DAYS[i]}?", f"Which day follows {DAYS[i]}?"])
    return q, f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."


def previous_month(rng):
    i = rng.randrange(12)
    q = rng.choice([f"Which month comes before {MONTHS[i]}?", f"What month is just before {MONTHS[i]}?"])
    return q, f"{MONTHS[(i - 1) % 12]} comes before {MONTHS[i]}."


def month_number(rng):
    i = rng.randrange(12)
    q = rng.choice([f"Which month of the year is {MONTHS[i]}?", f"What is the number of the month {MONTHS[i]}?"])
    return q, f"{MONTHS[i]} is month number {i + 1}."


def parity(rng):
    n = rng.randint(1, 500)
    q = rng.choice([f"Is {n} even or odd?", f"Tell me whether {n} is odd or even."])
    return q, f"{n} is {'even' if n % 2 == 0 else 'odd'}."


def larger(rng):
    a, b = rng.sample(range(1, 1000), 2)
    q = rng.choice([f"Which is larger, {a} or {b}?", f"Which number is bigger: {a} or {b}?"])
    big, small = max(a, b), min(a, b)
    return q, f"{big} is larger than {small}."


def sort_numbers(rng):
    nums = rng.sample(range(1, 100), rng.randint(3, 5))
    listed = ", ".join(map(str, nums))
    q = rng.choice([f"Sort these numbers from smallest to largest: {listed}.", f"Put {listed} in increasing order."])
    return q, f"In increasing order: {', '.join(map(str, sorted(nums)))}."


def spelled_number(rng):
    n = rng.randint(0, 10)
    q = rng.choice([f"How do you write the number {n} in words?", f"Spell out the number {n}."])
    return q, f"The number {n} is written '{NUMBER_NAMES[n]}'."


TASKS = [add, subtract, multiply, letters, backwards, uppercase, first_letter, minutes, meters, grams, next_day,
         previous_month, month_number, parity, larger, sort_numbers, spelled_number]


def conversation(rng):
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    turns = 2 if rng.random() < 0.25 else 1
    for _ in range(turns):
        question, answer = rng.choice(TASKS)(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat"))
    parser.add_argument("--train", type=int, default=900, help="train conversations")
    parser.add_argument("--val", type=int, default=100, help="val conversations")
    parser.add_argument("--seed", type=int, default=20261126)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    for split, count in (("train", args.train), ("val", args.val)):
        path = os.path.join(args.out_dir, f"chat_{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(json.dumps(conversation(rng)) + "\n")
        print(f"wrote {count} conversations to {path}")


if __name__ == "__main__":
    main()
