# SPDX-License-Identifier: MIT
"""Writes prompts/prompts.jsonl: the project's own prompt set, in SpecBench's question.jsonl format
(question_id, category, turns). All texts were written for this project (public domain / CC0).
Run `python prompts/make_prompts.py` after editing the lists below."""

import json
import os

PASSAGE_LIGHTHOUSE = (
    "The lighthouse on Karsk Point was built in 1871 after three ships were lost on the reef in a single "
    "winter. Its first keeper, Ingrid Holm, kept a logbook for thirty-two years, recording the weather "
    "every four hours, the ships that passed, and the birds that struck the lantern glass during the "
    "autumn migration. The original light burned whale oil and was visible for fourteen nautical miles. "
    "In 1904 it was converted to kerosene, which gave a brighter and steadier flame, and the range grew "
    "to nineteen miles. Electricity reached the point only in 1952, when a cable was laid along the "
    "causeway; the same year the keeper's cottage was enlarged to house a radio operator. The light was "
    "automated in 1987 and the last keeper, Tomas Brekke, moved to the mainland town of Solvik, where he "
    "opened a small museum with the logbooks, a brass fog horn, and the lantern's first Fresnel lens. "
    "Today the tower is owned by the Karsk Heritage Trust. Visitors can climb its 113 steps from May to "
    "September, but the tower is closed on Mondays and whenever the wind exceeds 60 kilometres per hour. "
    "The trust funds repairs from ticket sales and from an annual swim across the bay, held on the first "
    "Saturday of August, in which about two hundred people take part."
)
PASSAGE_BATTERY = (
    "A lithium-ion cell stores energy by moving lithium ions between two electrodes. During charging, "
    "ions leave the positive electrode, usually a metal oxide such as lithium iron phosphate or a "
    "nickel-manganese-cobalt mixture, travel through a liquid electrolyte, and settle between the layers "
    "of a graphite negative electrode. During discharge the flow reverses and electrons travel through "
    "the external circuit to power a device. A thin porous separator keeps the electrodes from touching; "
    "if it fails, the cell can short-circuit and overheat. Cells age in two ways. Calendar ageing happens "
    "even when a cell sits unused and is fastest when the cell is stored full and warm. Cycle ageing comes "
    "from repeated charging and discharging, which slowly grows a film called the solid electrolyte "
    "interphase on the graphite, trapping lithium that can no longer carry charge. Manufacturers therefore "
    "recommend storing cells at about half charge in a cool place, and many electric cars stop charging at "
    "eighty or ninety percent by default. Iron phosphate cells hold less energy per kilogram than "
    "nickel-based cells but tolerate more cycles and are less prone to thermal runaway, which is why they "
    "are common in buses and home storage, while nickel-rich chemistries dominate where weight matters most."
)
PASSAGE_RIVER = (
    "The Velna river rises in the Oster hills at an altitude of 1,240 metres and flows 412 kilometres to "
    "the sea. For most of its course it is slow and wide, but in the Drava gorge it drops 90 metres in "
    "six kilometres, and this stretch was dammed in 1963 to build the Drava hydroelectric station, which "
    "produces about 310 megawatts. The dam flooded the village of Lesko; its church tower still appears "
    "above the water in dry summers. Downstream the river feeds the irrigation canals of the Marn plain, "
    "where farmers grow sugar beet, wheat and sunflowers. Since 2010 the river authority has released a "
    "minimum flow of 35 cubic metres per second from the dam to protect the spawning grounds of the river's "
    "sturgeon, whose numbers had fallen by nine tenths since the dam was built. A fish ladder added in 2016 "
    "allows trout and eels to pass, but sturgeon are too large to use it, so biologists now carry young "
    "sturgeon around the dam by truck each spring. The river reaches the sea through a delta of three "
    "main channels, the largest of which, the Sora, is dredged every year to keep the port of Velnamund "
    "open to ships with a draught of up to eleven metres."
)
PASSAGE_COUNCIL = (
    "Minutes of the Elm Street Residents' Council, 14 March. Present: eleven members; chair: R. Okafor. "
    "1. The treasurer reported a balance of 2,340 euros after paying for the spring tree planting. "
    "2. The proposal to install four new benches along the canal path was discussed. Several members "
    "supported it, but two worried about noise late at night near the houses. It was agreed to install "
    "three benches, all on the side away from the houses, at a cost of 1,150 euros. Vote: nine in favour, "
    "two against. 3. The bicycle shed behind number 22 has a broken lock; M. Duarte will ask the city to "
    "repair it and report back in April. 4. The summer street party will be held on 21 June. Volunteers "
    "are needed for the barbecue and for cleaning up; a sign-up sheet will go round by email. The council "
    "decided not to hire a band this year and to use the money for children's games instead. 5. A member "
    "raised the problem of cars speeding on the corner with Birch Lane. The chair will write to the "
    "traffic department asking for a speed bump or a 30 km/h sign. The meeting closed at 21:10; the next "
    "meeting is on 11 April in the library."
)

ROWS = [
    # --- multi-turn chat / writing (SpecBench: MT-bench) ---
    ("writing", ["Write a short, friendly email to a neighbour inviting them to a garden barbecue on Saturday.",
                 "Now make it more formal."]),
    ("writing", ["Write a four-line poem about a lighthouse keeper.", "Give the poem a title and explain it."]),
    ("writing", ["Describe a busy morning market in a small town in one vivid paragraph.",
                 "Rewrite it from the point of view of a cat."]),
    ("writing", ["Give me three tips for writing a good cover letter, with one sentence of explanation each.",
                 "Which tip matters most?"]),
    # --- translation ---
    ("translation", ["Translate the following German sentence into English: "
                     "\"Der Zug nach Berlin hat heute wegen eines Sturms zwei Stunden Verspätung.\""]),
    ("translation", ["Translate into English: \"Le marché ouvre à huit heures, mais les meilleurs fruits "
                     "sont vendus avant neuf heures.\""]),
    ("translation", ["Translate into Spanish: \"My grandmother grows tomatoes, beans and sunflowers in "
                     "her garden every summer.\""]),
    ("translation", ["Translate the following English text into French: \"Please close the windows before "
                     "you leave the office, because it will rain tonight.\""]),
    # --- summarization ---
    ("summarization", ["Summarize the following text in three sentences.\n\n" + PASSAGE_LIGHTHOUSE]),
    ("summarization", ["Summarize the following text in a short paragraph.\n\n" + PASSAGE_BATTERY]),
    ("summarization", ["Write a two-sentence summary of this text.\n\n" + PASSAGE_RIVER]),
    ("summarization", ["Summarize the decisions taken in these meeting minutes as a bullet list.\n\n"
                       + PASSAGE_COUNCIL]),
    # --- question answering ---
    ("qa", ["What is the difference between weather and climate?"]),
    ("qa", ["Why do we have seasons on Earth?"]),
    ("qa", ["What does a compiler do?"]),
    ("qa", ["Who was Marie Curie and what is she known for?"]),
    # --- math reasoning ---
    ("math_reasoning", ["A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? "
                        "Explain step by step."]),
    ("math_reasoning", ["Tom is twice as old as his sister. In five years the sum of their ages will be 40. "
                        "How old is Tom now? Solve step by step."]),
    ("math_reasoning", ["A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its "
                        "average speed for the whole trip? Show your reasoning."]),
    ("math_reasoning", ["A rectangle has a perimeter of 30 cm and its length is twice its width. "
                        "Find its area step by step."]),
    # --- retrieval-augmented generation: answer from a long passage ---
    ("rag", ["Answer the question using only the passage.\n\nPassage: " + PASSAGE_LIGHTHOUSE +
             "\n\nQuestion: When can visitors climb the Karsk Point lighthouse, and what did the last keeper "
             "do after it was automated?"]),
    ("rag", ["Answer the question using only the passage.\n\nPassage: " + PASSAGE_BATTERY +
             "\n\nQuestion: Why are iron phosphate cells used in buses, and how should cells be stored?"]),
    ("rag", ["Answer the question using only the passage.\n\nPassage: " + PASSAGE_RIVER +
             "\n\nQuestion: How do sturgeon get past the Drava dam, and why can they not use the fish ladder?"]),
    ("rag", ["Answer the question using only the passage.\n\nPassage: " + PASSAGE_COUNCIL +
             "\n\nQuestion: How many benches will be installed, where, and what was the vote?"]),
    # --- code ---
    ("coding", ["Write a Python function is_palindrome(s) that ignores case and spaces, with a docstring "
                "and two example calls."]),
    ("coding", ["Write a Python class Stack with push, pop, peek and is_empty methods."]),
    ("coding", ["Write a JavaScript function that returns the sum of all even numbers in an array."]),
    ("coding", ["Write a SQL query that returns the five customers with the highest total order amount, "
                "given tables customers(id, name) and orders(id, customer_id, amount)."]),
]

if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, (category, turns) in enumerate(ROWS, start=1):
            f.write(json.dumps({"question_id": i, "category": category, "turns": turns}, ensure_ascii=False) + "\n")
    print(f"wrote {len(ROWS)} prompts to {path}")
