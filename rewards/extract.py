"""Structured output (issue #43, domain c): the named fields of a short text extracted into one JSON object, checked
against the kind's schema (its keys and their types) and the reference values.

A problem is one short text of a `kind` (a person, an order, a flight, ...), written from one of several templates,
optionally followed by a distractor sentence (`distractor: true`) with values of the same types that belong to
something else the text refers to (the person's sister, the order it replaces, last month's price): the model must
read which values are the subject's, not copy the first number or city it sees. The prompt is chat messages: a system
message that lists the keys and their types, and the text as the user's message. The answer is the reference
object as compact JSON; the demonstration (SFT warm start) is that object.

Verdict: the response's JSON object (the whole reply, a ```json fence, or the span from its first "{" to its last
"}") must have exactly the schema's keys with values of the schema's types (an integer field takes a JSON integer,
not a string of digits; a string field a string); then the reward is the share of fields whose value equals the
reference (strings compared after trimming surrounding blanks, case kept), and the answer is correct when all do.
An object with a missing, extra or mistyped key scores 0 ("schema: ..."), as does a reply with no JSON object.

Kinds are the sub-datasets of the domain (issue #43 splits every domain into sub-datasets, each with its own
teacher in the OPD stage): `kinds: [person]` with and without distractors makes two datasets of one kind. The
held-out split is a fixed 1-in-10 hash of the text's subject sentence (the text without its distractor: in it or
not whatever the dataset's name, seed or distractor setting), so datasets of this domain never train on each other's
held-out problems.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from rewards.procedural import DrawnTask, stable_int
from rewards.task import Message, Problem, Trajectory, Verdict, VerifyContext

FIRST = ("Ana", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Maya",
         "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe")
LAST = ("Silva", "Berg", "Novak", "Okafor", "Tanaka", "Weber", "Costa", "Haddad", "Lind", "Moreau", "Patel", "Rossi",
        "Schmidt", "Kowalski", "Ito", "Nguyen", "Larsen", "Fischer", "Duarte", "Ahmed")
CITIES = ("Lyon", "Oslo", "Porto", "Gdansk", "Leeds", "Graz", "Bergen", "Malmo", "Turin", "Ghent", "Cork", "Brno",
          "Basel", "Tartu", "Split", "Lille", "Bremen", "Aarhus", "Bilbao", "Krakow")
JOBS = ("nurse", "teacher", "plumber", "chemist", "pilot", "baker", "lawyer", "architect", "farmer", "librarian",
        "dentist", "carpenter", "journalist", "engineer", "florist")
ITEMS = ("lamps", "chairs", "kettles", "backpacks", "helmets", "mugs", "blankets", "candles", "scarves", "clocks",
         "umbrellas", "notebooks")
COLORS = ("red", "blue", "green", "black", "white", "yellow", "grey", "orange", "purple", "brown")
AIRLINES = (("Nordic Air", "NA"), ("Blue Sky", "BS"), ("Alpine Jet", "AJ"), ("Coastline", "CL"), ("Eastwind", "EW"),
            ("Sunway", "SW"))
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MEETINGS = ("budget meeting", "design review", "team lunch", "safety briefing", "quarterly planning", "board meeting",
            "code review", "training session")
CONDITIONS = ("sunny", "cloudy", "rainy", "foggy", "snowy", "windy", "stormy")
TEAMS = ("Rovers", "Falcons", "United", "Wanderers", "Athletic", "Rangers", "Titans", "Comets", "Harriers", "Lions")
ADJ = ("Silent", "Hidden", "Last", "Golden", "Broken", "Distant", "Winter", "Paper", "Iron", "Glass")
NOUNS = ("River", "Garden", "Harbor", "Letter", "Mountain", "Orchard", "Lantern", "Bridge", "Island", "Archive")

INT, STR = "integer", "string"


@dataclass(frozen=True)
class Kind:
    """One sort of text: its schema (key -> JSON type, in the order the demonstration writes them) and a generator of
    (text, reference values, a distractor sentence)."""

    schema: tuple[tuple[str, str], ...]
    make: Callable[[random.Random], tuple[str, dict, str]]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _other(rng: random.Random, pool, not_this):
    return rng.choice([x for x in pool if x != not_this])


def _person(rng):
    v = {"name": _name(rng), "age": rng.randint(19, 88), "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
    text = rng.choice((
        "{name} is a {age}-year-old {job} from {city}.",
        "Born {age} years ago, {name} now lives in {city} and works as a {job}.",
        "Our new {job}, {name} ({age}), moved here from {city}.",
        "{name}, {age}, {job}, based in {city}.",
    )).format(**v)
    other = f"{v['name'].split()[0]}'s sister, {rng.choice(FIRST)}, is a {_other(rng, JOBS, v['job'])} in {_other(rng, CITIES, v['city'])}."
    return text, v, other


def _order(rng):
    v = {"order_id": rng.randint(10000, 99999), "item": rng.choice(ITEMS), "quantity": rng.randint(2, 60),
         "city": rng.choice(CITIES)}
    text = rng.choice((
        "Order {order_id}: {quantity} {item}, shipped to {city}.",
        "We sent {quantity} {item} to {city} under order number {order_id}.",
        "Shipment for order #{order_id} ({quantity} {item}) left for {city} today.",
    )).format(**v)
    other = f"It replaces order {rng.randint(10000, 99999)} of {rng.randint(2, 60)} {_other(rng, ITEMS, v['item'])}, which was cancelled."
    return text, v, other


def _flight(rng):
    airline, code = rng.choice(AIRLINES)
    origin, destination = rng.sample(CITIES, 2)
    v = {"airline": airline, "flight": f"{code}{rng.randint(100, 999)}", "origin": origin, "destination": destination}
    text = rng.choice((
        "{airline} flight {flight} departs {origin} for {destination} at noon.",
        "Passengers of flight {flight} ({airline}) from {origin} to {destination}: boarding is at gate 4.",
        "The {airline} service {flight} flies {origin} to {destination} daily.",
    )).format(**v)
    o_airline, o_code = rng.choice(AIRLINES)
    other = f"It connects with {o_airline} flight {o_code}{rng.randint(100, 999)} to {_other(rng, CITIES, destination)}."
    return text, v, other


def _event(rng):
    v = {"event": rng.choice(MEETINGS), "day": rng.choice(DAYS), "time": f"{rng.randint(8, 18)}:{rng.choice(('00', '15', '30', '45'))}",
         "room": rng.randint(100, 499)}
    text = rng.choice((
        "The {event} is on {day} at {time} in room {room}.",
        "Reminder: {event}, {day} {time}, room {room}.",
        "On {day} the {event} starts at {time}; please come to room {room}.",
    )).format(**v)
    other = f"It was first planned for {_other(rng, DAYS, v['day'])} in room {rng.randint(100, 499)}."
    return text, v, other


def _product(rng):
    v = {"product": f"{rng.choice(COLORS)} {rng.choice(ITEMS)[:-1]}", "price": rng.randint(5, 400),
         "stock": rng.randint(0, 250), "color": ""}
    v["color"] = v["product"].split()[0]
    text = rng.choice((
        "The {product} costs {price} euros; {stock} are in stock.",
        "In stock: {stock} of the {product}, at {price} euros each.",
        "{product} - price {price} euros - {stock} left.",
    )).format(**v)
    other = f"Last month it cost {rng.randint(5, 400)} euros and {rng.randint(0, 250)} were in stock."
    return text, v, other


def _weather(rng):
    v = {"city": rng.choice(CITIES), "temperature": rng.randint(-15, 38), "condition": rng.choice(CONDITIONS),
         "wind": rng.randint(0, 90)}
    text = rng.choice((
        "{city}: {condition}, {temperature} degrees, wind {wind} km/h.",
        "In {city} it is {condition} today with {temperature} degrees and winds of {wind} km/h.",
        "Expect a {condition} day in {city}: {temperature} degrees, wind at {wind} km/h.",
    )).format(**v)
    other = f"Yesterday it was {rng.randint(-15, 38)} degrees there, and {_other(rng, CONDITIONS, v['condition'])} in {_other(rng, CITIES, v['city'])}."
    return text, v, other


def _book(rng):
    v = {"title": f"The {rng.choice(ADJ)} {rng.choice(NOUNS)}", "author": _name(rng), "year": rng.randint(1850, 2024),
         "pages": rng.randint(90, 900)}
    text = rng.choice((
        "{title} by {author} ({year}) runs to {pages} pages.",
        "{author} published {title} in {year}; it has {pages} pages.",
        "Published in {year}, {author}'s {title} is {pages} pages long.",
    )).format(**v)
    other = f"Its sequel, The {rng.choice(ADJ)} {rng.choice(NOUNS)}, came out in {rng.randint(v['year'] + 1, 2025)}."
    return text, v, other


def _match(rng):
    home, away = rng.sample(TEAMS, 2)
    v = {"home": home, "away": away, "home_goals": rng.randint(0, 6), "away_goals": rng.randint(0, 6)}
    text = rng.choice((
        "{home} beat {away} {home_goals}-{away_goals} at home." if v["home_goals"] > v["away_goals"] else
        "At home, {home} and {away} finished {home_goals}-{away_goals}.",
        "Final score: {home} {home_goals}, {away} {away_goals} (home team first).",
    )).format(**v)
    other = f"Last season the same match ended {rng.randint(0, 6)}-{rng.randint(0, 6)}."
    return text, v, other


def _contact(rng):
    first, last = rng.choice(FIRST), rng.choice(LAST)
    v = {"name": f"{first} {last}", "email": f"{first.lower()}.{last.lower()}@{rng.choice(('mail', 'post', 'inbox'))}.org",
         "phone": f"{rng.randint(200, 999)}-{rng.randint(1000, 9999)}", "city": rng.choice(CITIES)}
    text = rng.choice((
        "Contact {name} in {city} at {email} or {phone}.",
        "{name} ({city}): phone {phone}, email {email}.",
        "Reach our {city} office through {name}: {email}, tel. {phone}.",
    )).format(**v)
    other = f"For billing, call {rng.randint(200, 999)}-{rng.randint(1000, 9999)} instead."
    return text, v, other


def _recipe(rng):
    dishes = ("soup", "pie", "stew", "salad", "curry", "risotto", "omelette", "pancakes")
    ingredients = ("flour", "rice", "butter", "sugar", "milk", "onions", "carrots", "lentils")
    v = {"dish": rng.choice(dishes), "ingredient": rng.choice(ingredients), "grams": rng.randint(2, 80) * 10,
         "servings": rng.randint(1, 12)}
    text = rng.choice((
        "For the {dish} ({servings} servings) you need {grams} g of {ingredient}.",
        "This {dish} serves {servings}; its main ingredient is {ingredient}, {grams} g.",
        "Use {grams} grams of {ingredient} to make {dish} for {servings}.",
    )).format(**v)
    other = f"A double batch for {2 * v['servings']} needs {2 * v['grams']} g."
    return text, v, other


KINDS: dict[str, Kind] = {
    "person": Kind((("name", STR), ("age", INT), ("city", STR), ("job", STR)), _person),
    "order": Kind((("order_id", INT), ("item", STR), ("quantity", INT), ("city", STR)), _order),
    "flight": Kind((("airline", STR), ("flight", STR), ("origin", STR), ("destination", STR)), _flight),
    "event": Kind((("event", STR), ("day", STR), ("time", STR), ("room", INT)), _event),
    "product": Kind((("product", STR), ("color", STR), ("price", INT), ("stock", INT)), _product),
    "weather": Kind((("city", STR), ("temperature", INT), ("condition", STR), ("wind", INT)), _weather),
    "book": Kind((("title", STR), ("author", STR), ("year", INT), ("pages", INT)), _book),
    "match": Kind((("home", STR), ("away", STR), ("home_goals", INT), ("away_goals", INT)), _match),
    "contact": Kind((("name", STR), ("email", STR), ("phone", STR), ("city", STR)), _contact),
    "recipe": Kind((("dish", STR), ("ingredient", STR), ("grams", INT), ("servings", INT)), _recipe),
}
"""The domain's kinds (sub-datasets), each with its schema."""


def instructions(kind: str) -> str:
    """The system message: the keys, their types, and the reply's form."""
    keys = ", ".join(f'"{k}" ({t})' for k, t in KINDS[kind].schema)
    return f"Extract the fields of the text into one JSON object with the keys {keys}. Reply with the JSON object only."


def find_object(response: str) -> dict | None:
    """The JSON object of a reply: the whole reply, the inside of a ```json fence, or its first "{" to its last "}";
    None when none of them parses to an object."""
    text = response.strip()
    fence = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    candidates = [text] + ([fence.group(1)] if fence else [])
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{"):text.rindex("}") + 1])
    for c in candidates:
        try:
            obj = json.loads(c)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def judge(obj: dict | None, kind: str, reference: dict) -> Verdict:
    """The verdict of an extracted object against the kind's schema and the reference values (module docstring)."""
    if obj is None:
        return Verdict(0.0, False, "no JSON object in the reply", answered=False)
    schema = dict(KINDS[kind].schema)
    missing, extra = [k for k in schema if k not in obj], [k for k in obj if k not in schema]
    if missing or extra:
        return Verdict(0.0, False, "schema: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"extra {', '.join(map(str, extra))[:60]}"] if extra else [])),
            answered=True)
    for k, t in schema.items():
        v = obj[k]
        if (t == INT and (not isinstance(v, int) or isinstance(v, bool))) or (t == STR and not isinstance(v, str)):
            return Verdict(0.0, False, f"schema: {k} is {type(v).__name__}, not {t}", answered=True)
    wrong = [k for k in schema if (obj[k].strip() if isinstance(obj[k], str) else obj[k]) != reference[k]]
    reward = 1.0 - len(wrong) / len(schema)
    if not wrong:
        return Verdict(1.0, True, "all fields", answered=True)
    k = wrong[0]
    return Verdict(reward, False, f"{len(wrong)} of {len(schema)} fields wrong; {k}: {str(obj[k])[:30]!r}, expected "
                                  f"{reference[k]!r}", answered=True)


class ExtractTask(DrawnTask):
    """Texts of the given kinds (each problem's kind drawn uniformly), with a distractor sentence when `distractor`."""

    family = "extract"

    def __init__(self, name: str, *, kinds: list[str] | None = None, distractor: bool = False, num_heldout: int = 1000,
                 seed: int = 0):
        kinds = list(kinds or KINDS)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"extract: unknown kinds {unknown}; known: {', '.join(KINDS)}")
        if num_heldout < 1:
            raise ValueError(f"extract: num_heldout must be >= 1, got {num_heldout}")
        self.name, self.kinds, self.distractor, self.num_heldout, self.seed = name, kinds, distractor, num_heldout, seed
        self._heldout: list[Problem] | None = None

    def _draw(self, rng: random.Random) -> Problem:
        kind = rng.choice(self.kinds)
        core, values, other = KINDS[kind].make(rng)
        values = {k: values[k] for k, _ in KINDS[kind].schema}  # the schema's order
        text = core
        if self.distractor:
            text = f"{core} {other}"
        prompt = (Message("system", instructions(kind)), Message("user", text))
        return Problem(f"{self.name}:{kind}:{stable_int(text) % 10**12:012d}", self.name, prompt,
                       answer=json.dumps(values), metadata={"kind": kind, "values": values, "core": core})

    def _split_key(self, problem: Problem) -> str:
        return problem.metadata["core"]

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        m = trajectory.problem.metadata
        return judge(find_object(trajectory.response), m["kind"], m["values"])

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str:
        return json.dumps(problem.metadata["values"])
