"""Local training text for the demo BPE tokenizer (written for this project).

Plain prose about everyday things, chat-like turns, code-like lines, numbers and
punctuation, and lines in several scripts so that multi-byte UTF-8 is exercised:
rare CJK characters stay split over several byte tokens after training.
Kept as a module (not a data file) so that it ships with the package as is.
"""

from __future__ import annotations

PROSE = """\
The kettle clicked off just as the rain started to tap against the kitchen window.
She poured the water over the tea leaves and waited three minutes before taking the bag out.
On Saturday mornings the market opens at seven, and the bakery stall sells out by nine.
He bought a loaf of rye bread, a jar of honey and a small bunch of fresh basil.
The bus was late again, so I walked the last two stops and arrived with wet shoes.
Our neighbour keeps a vegetable garden with tomatoes, beans, peppers and a row of sunflowers.
Water the seedlings in the evening, when the sun is low and the soil stays cool.
The library moved to a new building near the river, with a reading room full of light.
If you want to learn to cook, start with soup: it forgives almost every mistake.
Chop an onion, soften it in butter, add carrots and potatoes, then cover with stock.
The children built a fort out of blankets and chairs and refused to come out for dinner.
My grandmother writes letters by hand and keeps every reply in a shoebox under her bed.
The train to the coast takes two hours, and the view gets better after the second tunnel.
We packed sandwiches, apples, a thermos of coffee and a paperback that nobody opened.
The dog waits by the door at half past five because that is when the walk usually starts.
A good pair of boots is worth more than a fancy jacket when the path turns to mud.
The repair shop said the bicycle needed a new chain, two brake pads and a little patience.
He checked the weather forecast twice and still forgot his umbrella on the bench.
The cafe on the corner plays old jazz records and serves the best lemon cake in town.
Every winter the lake freezes near the shore, and people skate in slow, careful circles.
The meeting ran long, so she ate lunch at her desk while answering a pile of emails.
Please remember to turn off the lights, lock the back door and feed the cat before you leave.
The recipe calls for two cups of flour, one egg, a pinch of salt and a splash of milk.
Mix the dry ingredients first, then fold in the wet ones until the batter is smooth.
The oven should be hot before the tray goes in; otherwise the cookies spread too thin.
Our team practises football on Tuesday and Thursday evenings at the school field.
The coach said that passing well matters more than running fast, and he was right.
After the match everyone shared oranges and talked about the goal that almost went in.
The museum has a room of old clocks that all chime at noon, one slightly after another.
A quiet street, a warm cup and a good book make a perfect Sunday afternoon.
The power went out during the storm, so we played cards by candlelight until midnight.
When the phone battery is low, close the apps you do not need and dim the screen.
The pharmacist explained that the tablets should be taken with food, twice a day.
Drink plenty of water, sleep well and take a short walk every day, the doctor said.
The hotel room was small but clean, and the window looked out over the old square.
We asked for directions to the station and a stranger walked us all the way there.
The fish soup at the harbour restaurant was salty, hot and exactly what we needed.
Learning a new language is easier when you listen to songs and repeat the choruses.
She keeps a notebook for new words and reviews it on the train every morning.
The plumber fixed the leaking tap in ten minutes and charged us for an hour.
Our street holds a yard sale every spring, and people trade books, toys and lamps.
The old radio still works if you tap it gently on the left side.
He planted an apple tree the year his daughter was born, and now they are both tall.
The garden needs rain; the grass has turned yellow and the roses look tired.
Fold the laundry while it is still warm and the shirts will need less ironing.
The cinema downtown shows old films on Wednesday nights for half the usual price.
Birds gather on the wires in autumn as if they were holding a meeting about the trip south.
The farmer said the harvest was good this year, better than the last three together.
A map, a compass and a full water bottle are the basics for any long hike.
The baby finally fell asleep, so we whispered and tiptoed around the flat for an hour.
Moving house takes longer than you think, and the boxes always multiply overnight.
The new neighbours brought a cake to say hello, and we invited them in for tea.
I forgot my keys at the office and had to wait for my brother to let me in.
Spring cleaning is a good excuse to open every window and listen to the birds.
The shop assistant helped me find a warm scarf in the exact shade of green I wanted.
The bridge is closed for repairs, so drivers must take the long road around the hill.
At the end of the day, the sky turned orange, then pink, then a deep and quiet blue.
Reading before bed helps me sleep, unless the story is too exciting to put down.
My uncle tells the same jokes at every family dinner, and we laugh every single time.
The swimming pool opens early for people who like to swim before work.
Cycling to work saves money, keeps you fit and gives you time to think.
The price of coffee went up again, so I started making it at home.
Snow covered the cars overnight, and the whole street was silent in the morning.
The teacher asked the class to write a short story about a day at the seaside.
Good questions are often more useful than quick answers.
Let the dough rest for an hour in a warm place until it doubles in size.
The cat sleeps in the sunniest spot in the house and moves with the light all day.
The festival ended with fireworks over the river and music until late at night.
Remember to back up your photos; phones get lost, dropped and stolen.
A small kindness, like holding a door, can change the mood of a whole morning.
The mechanic listened to the engine for a moment and knew exactly what was wrong.
We counted the stars from the roof until the clouds rolled in from the west.
The post office closes early on Fridays, so send the parcel before three o'clock.
The soup needs more salt, a little pepper and maybe a squeeze of lemon.
The village has one shop, one school, one church and far too many cats.
The laundromat smells of soap and warm cotton, and the dryers hum like distant engines.
She labelled every jar in the pantry so that nobody would confuse the sugar with the salt again.
On the first warm evening of the year the whole neighbourhood seemed to be sitting outside.
The plumber left a note: do not use the upstairs shower until the pipe has dried.
Grandfather taught me to sharpen a pencil with a knife and to whistle with two fingers.
The ferry leaves every forty minutes, and the crossing is calm when the wind is from the south.
A loaf of bread keeps longer in a cloth bag than in plastic, my aunt insists.
We repainted the fence on Sunday and spent Monday scrubbing white paint off our hands.
The chess club meets in the back room of the cafe, where the tables have boards painted on them.
Mushrooms popped up all over the lawn after three days of steady rain.
The night shift nurse brought us hot chocolate and a blanket at two in the morning.
If the soup is too thick, add a little water; if it is too thin, let it simmer a while longer.
The kids sold lemonade at the corner and donated the money to the animal shelter.
Our car makes a strange noise when it turns left, but only on cold mornings.
The tailor shortened my trousers by two centimetres and sewed on a missing button for free.
He keeps a spare key under a flower pot, which is the first place anyone would look.
The farmers' market has a stall that sells nothing but twenty kinds of apples.
Bring a pen, your passport and a copy of the booking, just in case the system is down.
The fog was so thick that we could barely see the end of the pier.
My sister learned to knit last winter and now everyone in the family owns a scarf.
The clock in the hallway is five minutes fast, so we are never quite as late as we think.
At the top of the hill there is a bench with a view of the whole valley.
Squirrels buried nuts all over the garden, and now small oak trees are growing in the flower beds.
The supermarket moved the bread to the other end of the shop, and nobody can find it.
I wrote the shopping list on the back of an envelope and then left it on the kitchen table.
The old man at the park feeds the pigeons every morning at exactly eight o'clock.
The concert was sold out, so we listened from the grass outside the hall.
A cup of warm milk with honey is my grandmother's cure for almost everything.
The pharmacy on the high street is open until ten, even on Sundays.
When the snow melts, the river rises and the stepping stones disappear under the water.
Tomorrow will be sunny with a light breeze, and the temperature will reach twenty degrees.
"""

DIALOGUE = """\
User: Can you suggest something quick for dinner tonight?
Assistant: Sure. A vegetable stir fry with rice takes about twenty minutes and uses whatever you have in the fridge.
User: What is a good way to start running?
Assistant: Begin with short runs mixed with walking, three times a week, and add a few minutes each week.
User: How do I keep basil alive on a windowsill?
Assistant: Give it plenty of light, water it when the top of the soil feels dry, and pinch off the flowers.
User: Why is the sky blue?
Assistant: Sunlight is scattered by the air, and blue light is scattered more than red light, so the sky looks blue.
User: Thank you, that helps a lot!
Assistant: You are welcome. Let me know if you have any other questions.
User: Write a short poem about the sea.
Assistant: Grey waves fold and unfold, / the gulls complain about the cold, / and the tide keeps every secret told.
User: How many minutes are there in a day?
Assistant: There are 24 hours in a day and 60 minutes in an hour, so a day has 1440 minutes.
User: Translate "good morning" into French.
Assistant: "Good morning" in French is "bonjour".
User: What should I pack for a weekend in the mountains?
Assistant: Warm layers, a rain jacket, sturdy shoes, a hat, sunscreen, snacks and a small first aid kit.
User: Summarise the plot of your favourite book in one sentence.
Assistant: A young sailor gets lost at sea, learns to read the stars, and finds his way home a wiser man.
User: Is it better to study in the morning or at night?
Assistant: It depends on you; many people remember more after studying in the morning and sleeping well.
User: My bread never rises. What am I doing wrong?
Assistant: The yeast may be old or the water too hot; try lukewarm water and a warm place for the dough.
User: How long should I boil an egg?
Assistant: About six minutes for a soft yolk and ten minutes for a hard one, starting from boiling water.
User: Can you help me plan a picnic?
Assistant: Of course. Pick a shady spot, pack sandwiches, fruit, water and a blanket, and check the forecast.
User: What is the difference between weather and climate?
Assistant: Weather is what happens on a given day; climate is the average pattern over many years.
"""

CODE = r"""def add(a, b):
    return a + b

def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count

for i in range(10):
    print(f"step {i}: {i * i}")

with open("notes.txt", encoding="utf-8") as f:
    lines = [line.strip() for line in f if line.strip()]

result = {"name": "kettle", "price": 24.99, "in_stock": True, "tags": ["kitchen", "tea"]}
import json, os, sys
print(json.dumps(result, indent=2))
if __name__ == "__main__":
    main(sys.argv[1:])
x = [1, 2, 3]; y = [v * 2 for v in x]; assert y == [2, 4, 6]
path = os.path.join(os.getcwd(), "data", "shopping_list.csv")
function greet(name) { return `Hello, ${name}!`; }
const total = items.reduce((sum, item) => sum + item.price, 0);
let isReady = false; while (!isReady) { isReady = check(); }
SELECT name, price FROM products WHERE price < 10 ORDER BY name;
UPDATE orders SET status = 'shipped' WHERE id = 42;
<div class="card"><h2>Weekend plans</h2><p>Hiking &amp; picnic</p></div>
#include <stdio.h>
int main(void) { printf("%d\n", 1 + 2); return 0; }
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
git commit -m "Fix typo in README" && git push origin main
ls -la /home/user/docs | grep ".txt" | wc -l
curl -s http://localhost:8080/health && echo "ok"
{"role": "user", "content": "What time is it?"}
{"id": 7, "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-205", "qty": 1}], "paid": false}
key = value  # comment
x != y && (a <= b || c >= d)
matrix[i][j] = matrix[i - 1][j] + matrix[i][j - 1]
return {k: v for k, v in pairs if v is not None}
try:
    value = int(text)
except ValueError:
    value = 0
def read_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

squares = list(map(lambda n: n ** 2, range(1, 6)))  # [1, 4, 9, 16, 25]
name = input("Your name: ").strip() or "friend"
while queue:
    node = queue.pop(0)
    visited.add(node)
"""

NUMBERS = """\
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20
0.5 + 0.25 = 0.75; 3.14159 is close to pi; 2.71828 is close to e.
The bill came to $42.50, plus a 10% tip of $4.25, so $46.75 in total.
Call 555-0134 between 9:00 and 17:30, Monday to Friday.
The meeting is on 2024-03-15 at 14:00 in room B-12.
Temperatures ranged from -3 C at night to 18 C in the afternoon.
A kilogram is 1000 grams, and a litre of water weighs about 1 kg.
In 1969 people first walked on the Moon; in 1989 the Berlin Wall fell.
Page 7 of 250; chapter 3, section 2.1, paragraph 4.
The recipe serves 4 to 6 people and takes 45 minutes (plus 1 hour of resting).
Version 2.0.1 fixed 17 bugs and added 3 new features.
Score: 3-1 after 90 minutes; attendance was 12,480.
Order #10293 shipped on 05/06/2023 with tracking code ZX-77-104.
The rent is 850 per month, or 10,200 per year.
Prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47.
Powers of two: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096.
Wait... really?! Yes -- really. (Well, mostly.) "Quotes", 'apostrophes' and [brackets] {braces} <angles>.
Email me at someone@example.com or visit https://example.org/path?q=1&lang=en#top.
Ratio 3:2, fraction 7/8, percentage 12.5%, range 10-20, hashtag #weekend, mention @friend.
"""

MULTILINGUAL = """\
今天天气很好，我们去公园散步吧。
我喜欢喝茶，尤其是绿茶和乌龙茶。
这家小饭馆的饺子非常好吃，价格也不贵。
周末我打算在家看书、做饭、打扫房间。
请问火车站怎么走？一直往前走，然后左转。
学习一门新的语言需要时间和耐心。
明天早上八点开会，请不要迟到。
春天来了，花园里的花都开了。
他每天骑自行车上班，路上大约二十分钟。
谢谢你的帮助！不客气，这是我应该做的。
今日はいい天気ですね。散歩に行きましょう。
駅までの道を教えてください。まっすぐ行って、二つ目の角を右です。
朝ごはんにご飯と味噌汁と焼き魚を食べました。
週末は友だちと映画を見に行く予定です。
この本はとても面白いので、ぜひ読んでみてください。
ありがとうございます。どういたしまして。
雨が降りそうなので、傘を持って行ったほうがいいですよ。
오늘은 날씨가 정말 좋네요. 공원에 산책하러 갈까요?
저는 아침마다 커피 한 잔을 마십니다.
주말에 가족과 함께 시장에 가서 과일을 샀어요.
도서관은 몇 시에 문을 닫나요? 저녁 아홉 시에 닫습니다.
한국어를 배우는 것은 어렵지만 재미있어요.
감사합니다. 천만에요.
Сегодня хорошая погода, давайте пойдём гулять в парк.
Я люблю читать книги вечером с чашкой горячего чая.
Как пройти к вокзалу? Идите прямо, потом поверните налево.
В субботу мы ездили на дачу и собирали яблоки.
Спасибо за помощь! Пожалуйста, обращайтесь.
Зимой здесь много снега, а летом очень жарко.
Le café du coin ouvre à sept heures et ferme très tard le vendredi.
Où est la gare, s'il vous plaît ? C'est à côté de la bibliothèque.
Nous avons mangé une crème brûlée délicieuse après le dîner.
¿Dónde está la estación? Está cerca del mercado, a la derecha.
Mañana vamos a la playa si no llueve; ¡qué ganas tengo!
El niño comió una manzana y después jugó en el jardín con su abuela.
Ich möchte einen Kaffee und ein Stück Käsekuchen, bitte.
Die Straßenbahn fährt alle zehn Minuten zum Bahnhof.
Übung macht den Meister, sagt meine Großmutter immer.
Eu gosto de caminhar na praia ao pôr do sol.
O pão de queijo está quentinho e a chávena de café também.
Dziękuję bardzo! Proszę bardzo, to żaden kłopot.
Hôm nay trời đẹp quá, chúng ta đi dạo nhé.
Bugün hava çok güzel, parkta yürüyüş yapalım mı?
Καλημέρα! Θέλετε ένα φλιτζάνι καφέ;
नमस्ते, आप कैसे हैं? मैं ठीक हूँ, धन्यवाद।
مرحبا، كيف حالك اليوم؟
שלום, מה שלומך?
สวัสดีครับ วันนี้อากาศดีมาก
Great job! 🎉 See you tomorrow 👋
I love pizza 🍕 and ice cream 🍦 on hot days ☀️
Weather today: ☁️ 🌧️ then ☀️ in the afternoon.
The team won! 🏆⚽ Everyone was so happy 😄😄
Good night 🌙✨ sleep well 😴
我们明天早上一起去爬山吧，记得带水和帽子。
这本书我已经看了三遍，每次都有新的感受。
冬天的时候，北方常常下雪，南方却很少见到。
妈妈做的红烧肉是全家人最喜欢的菜。
地铁站就在超市旁边，走路五分钟就到了。
電車が遅れているので、少し遅くなります。
日曜日は家でゆっくり休みたいです。
この店のラーメンはとても美味しいと評判です。
春になると、桜の花がきれいに咲きます。
저녁에 같이 영화 보러 갈래요?
이 식당의 김치찌개가 정말 맛있어요.
내일은 비가 온다고 하니까 우산을 챙기세요.
Мы встретились у входа в библиотеку ровно в шесть часов.
Летом мы часто ездим на озеро купаться и ловить рыбу.
Этот суп очень вкусный, дай мне, пожалуйста, рецепт.
La bibliothèque municipale prête aussi des jeux de société et des outils de jardinage.
Après la pluie, les escargots sortent et traversent lentement l'allée.
El mercado abre los sábados por la mañana y cierra a las dos de la tarde.
Me encanta el olor del pan recién hecho en la panadería de la esquina.
Im Herbst sammeln die Kinder Kastanien und basteln kleine Tiere daraus.
Der Zug hat zwanzig Minuten Verspätung, also trinken wir noch einen Tee.
A feira de domingo tem frutas frescas, flores e pastéis quentinhos.
Čeština, slovenčina, hrvatski: šťastný, žluťoučký kůň, čarobni štapić.
Íslenska og føroyskt: þakka þér fyrir, góðan daginn, ærligt og øl.
Tiếng Việt có nhiều dấu: ăn cơm, uống nước, đọc sách, nghỉ ngơi.
Les élèves ont écrit « bonne année » sur le tableau noir.
Coffee ☕ and croissants 🥐 for breakfast, then a walk in the park 🌳🐕
Packing list ✅ passport ✅ tickets ✅ charger ❌ oops 😅
Rainy day mood: 🌧️📚🍵 and a cat 🐈 on my lap.
Congratulations on the new job! 🥳🎊 Let's celebrate 🍰🥂
Happy birthday 🎂🎈 to my best friend ❤️
Let's go hiking 🥾🏔️ this weekend, okay? 👍
Family: 👨‍👩‍👧‍👦 flags: 🇫🇷 🇯🇵 🇧🇷 skin tones: 👋🏽 👍🏿
Math symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ → ← ↑ ↓ ° € £ ¥ © ® ™ § ¶ • … — –
"""

CORPUS_SECTIONS: tuple[str, ...] = (PROSE, DIALOGUE, CODE, NUMBERS, MULTILINGUAL)


def corpus_lines() -> list[str]:
    """All corpus lines, in a fixed order (training must be deterministic)."""
    return [line for section in CORPUS_SECTIONS for line in section.splitlines() if line.strip()]
